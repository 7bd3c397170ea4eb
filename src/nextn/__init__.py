"""nextn: engines with a fused verify-and-draft step for self-drafting LLM checkpoints (DeepSeek MTP, Medusa).

    from nextn import LLM, SamplingParams
    llm = LLM("engine_dir", speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 3})
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

__version__ = "0.1.0"

from nextn.quantization.weight_only import QuantConfig  # noqa: E402
from nextn.runtime.llm import LLM  # noqa: E402
from nextn.runtime.outputs import CompletionOutput, RequestOutput  # noqa: E402
from nextn.runtime.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "QuantConfig", "RequestOutput", "CompletionOutput", "__version__"]
