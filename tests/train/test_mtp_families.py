"""`nextn train-draft --method mtp` beyond Llama / Qwen2 (issues 60 and 62): for a tiny random base of each family
(made by `transformers` at test time) the engine's MTP module — read from the checkpoint the trainer writes — computes
what the training module computes (logits over a sequence, against `MtpContext.vanilla`), GLM-4.5's MoE block
included (Qwen3-MoE's, Qwen2-MoE's gated shared expert, Mixtral's, OLMoE's), Qwen3.5's gated attention over its
Gated DeltaNet base, Phi-3's fused projections, SmolLM3's NoPE layers, EXAONE 4's (its hybrid model's full layers are
NoPE; the MTP layer rotates, as the engine's), Granite's multipliers, Gemma 2's soft-capped head; and an unsupported
family is refused by name."""

from __future__ import annotations

import pytest
import torch

from nextn.models.llama import LlamaForCausalLM, LlamaModelConfig, to_runtime
from nextn.models.llama.weights import stored_view
from nextn.testing.mtp_check import mtp_pass
from nextn.testing.tiny_families import tiny_hf_model
from nextn.train.mtp import MtpContext, base_context, mtp_module
from nextn.train.mtp_checkpoint import mtp_config
from nextn.train.tiny_checkpoint import split_experts


class _Stored:
    """A checkpoint held in memory, read as `build-engine` reads one (names / has / get / tensor_info)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def tensor_info(self, name: str) -> tuple[str, list[int]]:
        return "F32", list(self.tensors[name].shape)


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2", "glm4_moe", "gemma3_text", "phi3", "smollm3", "granite",
                                        "qwen3_moe", "qwen3_5_text", "gemma2", "seed_oss", "glm4", "olmo3",
                                        "mixtral", "olmoe", "exaone4", "qwen2_moe"])
def test_engine_mtp_module_matches_the_training_module(model_type):
    hf = tiny_hf_model(model_type, **({"num_hidden_layers": 8} if model_type == "gemma3_text" else {}))
    module = mtp_module(hf.config).eval()  # Seed-OSS's config has dropout
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.add_(0.05 * torch.randn_like(p)) if p.dim() == 1 else p.normal_(0.0, p.shape[-1] ** -0.5)
    n = hf.config.num_hidden_layers
    state = split_experts({k: v.detach() for k, v in hf.state_dict().items()})
    state.update({f"model.layers.{n}.{k}": t for k, t in module.checkpoint_tensors().items()})
    moe = model_type in ("glm4_moe", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe")  # (write_mtp_checkpoint sets mtp_moe for an MoE block)
    cfg = LlamaModelConfig.from_hf(mtp_config(hf.config.to_dict(), 1, moe))  # as write_mtp_checkpoint declares it
    stored = stored_view(_Stored(state), cfg)  # as build-engine reads it (GLM-4.5's partial rotary: q/k rows)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions=1)
    model.load_state_dict(dict(to_runtime(stored.get, stored.has, cfg, torch.float32)), strict=True, assign=True)
    model.rope_table = model.rope_table_for(64)
    model.eval().requires_grad_(False)
    assert type(model.model.layers[n].mlp).__name__ == ("SparseMoE" if moe else "GatedMLP")
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    model.allocate_recurrent_state(2, 1, "cpu")  # Qwen3.5's Gated DeltaNet layers (no-op elsewhere)
    model.bind_batch_slots(torch.arange(2))
    hidden, h1, logits = mtp_pass(model, ids)
    embed, rotary = base_context(hf.model)
    ctx = MtpContext(embed, hf.lm_head.weight, rotary)
    with torch.no_grad():
        ref = hf.model(ids).last_hidden_state
        x, *_ = ctx.vanilla(torch.nn.ModuleList([module]), ids, ref, torch.ones(2, dtype=torch.int64),
                            torch.full((2,), 12))[0]
        want = x @ hf.lm_head.weight.T / (getattr(hf.config, "logits_scaling", None) or 1.0)
        if (cap := getattr(hf.config, "final_logit_softcapping", None)) is not None:  # Gemma 2's, in the engine's head
            want = cap * torch.tanh(want / cap)
    torch.testing.assert_close(hidden, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[:, :10], want[:, :10], atol=1e-3, rtol=1e-3)
    assert not torch.allclose(model.logits(h1)[:, :10], want[:, :10], atol=1e-2)  # control: the main norm instead


def test_an_unsupported_base_is_refused_by_name():
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="falcon"):
        mtp_module(AutoConfig.for_model("falcon"))


def test_warm_start_zeroes_every_down_projection_of_an_moe_block():
    """The identity start (`warm_start_from_base`) of GLM-4.5's MoE block: routed experts' (one 3-D tensor in
    `transformers`) and shared experts' down projections all zero, so the block passes its input through."""
    module = mtp_module(tiny_hf_model("glm4_moe").config)
    module.warm_start_from_base(1.0)
    downs = {n: p for n, p in module.block.mlp.named_parameters() if "down_proj" in n}
    assert set(downs) == {"experts.down_proj", "shared_experts.down_proj.weight"}
    assert all(not p.any() for p in downs.values())


def test_an_moe_blocks_stacked_experts_are_initialised():
    """`transformers` leaves a Qwen3-MoE layer's stacked expert weights as `torch.empty` until a model initialises
    them (a training loss of NaN from the first step, from whatever memory held): the module draws them."""
    module = mtp_module(tiny_hf_model("qwen3_moe").config)
    experts = module.block.mlp.experts
    for p in (experts.gate_up_proj, experts.down_proj):
        assert torch.isfinite(p).all() and abs(p.std().item() * p.shape[-1] ** 0.5 - 1.0) < 0.1


def test_a_qwen3_5_base_gets_its_trained_layer_in_place_of_the_released_one(tmp_path):
    """write_mtp_checkpoint on a Qwen3.5 checkpoint that ships `mtp.*`: the trained layer replaces it, declared as
    the family reads it (`mtp_num_hidden_layers`), chained on block outputs as it was trained."""
    import json

    from safetensors import safe_open

    from nextn.testing.tiny_families import add_qwen3_5_mtp
    from nextn.train.mtp_checkpoint import write_mtp_checkpoint

    hf = tiny_hf_model("qwen3_5_text")
    hf.save_pretrained(tmp_path / "base")
    add_qwen3_5_mtp(tmp_path / "base")
    module = mtp_module(hf.config)
    write_mtp_checkpoint(tmp_path / "base", [module.checkpoint_tensors()], tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        names = list(f.keys())
    n = hf.config.num_hidden_layers
    assert not any(k.startswith("mtp.") for k in names) and f"model.layers.{n}.eh_proj.weight" in names
    cfg = LlamaModelConfig.from_hf(config)
    assert (cfg.num_nextn_predict_layers, cfg.mtp_chain_normed) == (1, False)
