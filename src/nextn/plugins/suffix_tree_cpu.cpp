// The suffix trie of suffix decoding in C++ (nextn plugin; the Python reference, whose semantics this follows
// operation for operation — the same node ids, counts, best children and proposals — is
// speculative/suffix_tree.py; the loader and wrapper: plugins/suffix_tree_native.py).
//
// A depth-bounded trie with occurrence counts (Oliaro et al., "SuffixDecoding", NeurIPS 2025, arXiv 2411.04975):
// every suffix of every sequence is inserted up to depth D, so a node counts the occurrences of its path. Nodes are
// ids into flat arrays (token, count, best child, first child / next and previous sibling); (parent, token) ->
// child lives in one hash map. Freed ids are reused last-freed first, as the reference does, so ids agree.
//
// Why C++: the drafter updates the trees for every emitted token (O(D) nodes each) and proposes every step; in
// Python that is ~30 us a token, ~0.1-0.4 ms a request-step on real workloads, a millisecond or more a step at 16
// requests (docs/performance-history.md, "Suffix calibration per request ...").

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int32_t kNone = -1;   // no node (a leaf's best child, an empty list's end)
constexpr int32_t kStale = -2;  // a best child to recompute (a removal changed a child's count)
constexpr int32_t kRoot = 0;

inline uint64_t edge(int32_t node, int32_t token) {
  return (uint64_t(uint32_t(node)) << 32) | uint32_t(token);
}

class SuffixTreeCpu {
 public:
  explicit SuffixTreeCpu(int max_depth) : max_depth_(max_depth) {
    if (max_depth < 1 || max_depth > 64) throw py::value_error("max_depth must be in [1, 64]");
    push_node(-1);
  }

  int max_depth() const { return max_depth_; }
  int64_t version() const { return version_; }
  int64_t num_nodes() const { return int64_t(count_.size()) - 1 - int64_t(free_.size()); }
  int64_t held() const { return count_[kRoot]; }

  int32_t best_child(int32_t node) {
    int32_t b = best_[node];
    if (b == kStale) {
      b = kNone;
      for (int32_t c = first_[node]; c != kNone; c = next_[c]) {
        if (b == kNone || count_[c] > count_[b] || (count_[c] == count_[b] && token_[c] < token_[b])) b = c;
      }
      best_[node] = b;
    }
    return b;
  }

  std::vector<int32_t> extend(int64_t seq_id, const std::vector<int32_t>& tokens) {
    const size_t keep = size_t(max_depth_ - 1);
    std::vector<int32_t> ends = ends_[seq_id];
    std::vector<int32_t> fresh;
    for (int32_t t : tokens) {
      fresh.clear();
      const size_t n = std::min(keep, ends.size());
      for (size_t i = 0; i <= n; ++i) {  // the root, then each suffix of length 1..D-1
        const int32_t node = i == 0 ? kRoot : ends[i - 1];
        int32_t child = find(node, t);
        if (child == kNone) child = add_child(node, t);
        const int32_t c = ++count_[child];
        const int32_t b = best_[node];
        if (b != child && b != kStale && (b == kNone || c > count_[b] || (c == count_[b] && t < token_[b])))
          best_[node] = child;
        fresh.push_back(child);
      }
      ends.swap(fresh);
    }
    count_[kRoot] += int32_t(tokens.size());
    auto& seq = seqs_[seq_id];
    seq.insert(seq.end(), tokens.begin(), tokens.end());
    ends_[seq_id] = ends;
    return ends;
  }

  void close(int64_t seq_id) { ends_.erase(seq_id); }

  void remove(int64_t seq_id) {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) throw py::key_error(std::to_string(seq_id));
    const std::vector<int32_t> seq = std::move(it->second);
    seqs_.erase(it);
    ends_.erase(seq_id);
    ++version_;
    count_[kRoot] -= int32_t(seq.size());
    for (size_t start = 0; start < seq.size(); ++start) {
      int32_t node = kRoot;
      const size_t stop = std::min(seq.size(), start + size_t(max_depth_));
      for (size_t p = start; p < stop; ++p) {
        int32_t child = find(node, seq[p]);
        if (child == kNone) throw std::logic_error("suffix tree: a removed sequence's path is missing");
        --count_[child];
        if (best_[node] == child) best_[node] = kStale;
        if (count_[child] == 0) {
          // its only occurrence was this one: its subtree is a chain of count-1 nodes, all dropped
          unlink(node, child);
          while (child != kNone) {
            const int32_t grand = first_[child];
            if (grand != kNone) kids_.erase(edge(child, token_[grand]));
            free_.push_back(child);
            first_[child] = kNone;
            child = grand;
          }
          break;
        }
        node = child;
      }
    }
  }

  std::vector<int32_t> match(const std::vector<int32_t>& context) const {
    std::vector<int32_t> ends;
    const size_t n = context.size();
    const size_t longest = std::min(size_t(max_depth_), n);
    for (size_t m = 1; m <= longest; ++m) {
      int32_t node = kRoot;
      for (size_t p = n - m; p < n; ++p) {
        node = find(node, context[p]);
        if (node == kNone) return ends;
      }
      ends.push_back(node);
    }
    return ends;
  }

  std::vector<int32_t> extend_match(const std::vector<int32_t>& ends, int32_t token) const {
    std::vector<int32_t> out;
    const size_t n = std::min(ends.size(), size_t(max_depth_ - 1));
    for (size_t i = 0; i <= n; ++i) {
      const int32_t child = find(i == 0 ? kRoot : ends[i - 1], token);
      if (child == kNone) break;
      out.push_back(child);
    }
    return out;
  }

  // extend_match over each of `tokens` in turn (one call for a step's emitted tokens)
  std::vector<int32_t> extend_match_all(std::vector<int32_t> ends, const std::vector<int32_t>& tokens) const {
    for (int32_t t : tokens) ends = extend_match(ends, t);
    return ends;
  }

  // (tokens, score, match_len, gains): the reference's `propose`, the same double arithmetic in the same order
  std::tuple<std::vector<int32_t>, double, int, std::vector<double>> propose(const std::vector<int32_t>& ends,
                                                                            int max_tokens, double spec_factor,
                                                                            double min_token_prob) {
    std::vector<int32_t> best_tokens, tokens;
    std::vector<double> best_gains, gains;
    double best_score = 0.0;
    int best_m = 0;
    for (int m = int(ends.size()); m >= 1; --m) {
      const int budget = std::min(max_tokens, int(m * spec_factor + 1e-6));
      if (budget <= best_score) break;  // a score is at most its budget, and budgets shrink with m
      int32_t node = ends[m - 1];
      double prob = 1.0, score = 0.0;
      tokens.clear();
      gains.clear();
      while (int(tokens.size()) < budget && first_[node] != kNone) {
        const int32_t child = best_child(node);
        if (child == kNone) break;
        prob *= double(count_[child]) / double(count_[node]);
        if (prob < min_token_prob) break;
        tokens.push_back(token_[child]);
        score += prob;
        gains.push_back(score);
        node = child;
      }
      if (score > best_score) {
        best_score = score;
        best_m = m;
        best_tokens = tokens;
        best_gains = gains;
      }
    }
    return {best_tokens, best_score, best_m, best_gains};
  }

  int32_t count(int32_t node) const { return count_.at(node); }
  int32_t token(int32_t node) const { return token_.at(node); }

  // a node's children as (token, child) pairs, most recently added first (inspection and tests)
  std::vector<std::pair<int32_t, int32_t>> children(int32_t node) const {
    std::vector<std::pair<int32_t, int32_t>> out;
    for (int32_t c = first_.at(node); c != kNone; c = next_[c]) out.emplace_back(token_[c], c);
    return out;
  }

 private:
  int32_t find(int32_t node, int32_t token) const {
    if (first_[node] == kNone) return kNone;
    auto it = kids_.find(edge(node, token));
    return it == kids_.end() ? kNone : it->second;
  }

  int32_t push_node(int32_t token) {
    token_.push_back(token);
    count_.push_back(0);
    best_.push_back(kNone);
    first_.push_back(kNone);
    next_.push_back(kNone);
    prev_.push_back(kNone);
    return int32_t(count_.size()) - 1;
  }

  int32_t add_child(int32_t node, int32_t token) {
    int32_t i;
    if (!free_.empty()) {
      i = free_.back();
      free_.pop_back();
      token_[i] = token;
      count_[i] = 0;
      best_[i] = kNone;
      first_[i] = kNone;
    } else {
      i = push_node(token);
    }
    next_[i] = first_[node];
    prev_[i] = kNone;
    if (first_[node] != kNone) prev_[first_[node]] = i;
    first_[node] = i;
    kids_.emplace(edge(node, token), i);
    return i;
  }

  void unlink(int32_t node, int32_t child) {
    kids_.erase(edge(node, token_[child]));
    if (prev_[child] != kNone) next_[prev_[child]] = next_[child];
    else first_[node] = next_[child];
    if (next_[child] != kNone) prev_[next_[child]] = prev_[child];
  }

  int max_depth_;
  int64_t version_ = 0;
  std::vector<int32_t> token_, count_, best_, first_, next_, prev_;
  std::vector<int32_t> free_;
  std::unordered_map<uint64_t, int32_t> kids_;
  std::unordered_map<int64_t, std::vector<int32_t>> seqs_;
  std::unordered_map<int64_t, std::vector<int32_t>> ends_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<SuffixTreeCpu>(m, "SuffixTreeCpu")
      .def(py::init<int>())
      .def_property_readonly("max_depth", &SuffixTreeCpu::max_depth)
      .def_property_readonly("version", &SuffixTreeCpu::version)
      .def_property_readonly("num_nodes", &SuffixTreeCpu::num_nodes)
      .def_property_readonly("held", &SuffixTreeCpu::held)
      .def("best_child", &SuffixTreeCpu::best_child)
      .def("extend", &SuffixTreeCpu::extend)
      .def("close", &SuffixTreeCpu::close)
      .def("remove", &SuffixTreeCpu::remove)
      .def("match", &SuffixTreeCpu::match)
      .def("extend_match", &SuffixTreeCpu::extend_match)
      .def("extend_match_all", &SuffixTreeCpu::extend_match_all)
      .def("propose", &SuffixTreeCpu::propose)
      .def("count", &SuffixTreeCpu::count)
      .def("token", &SuffixTreeCpu::token)
      .def("children", &SuffixTreeCpu::children);
}
