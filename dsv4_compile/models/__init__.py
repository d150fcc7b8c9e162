"""The DSV4 attention block and a small model around it, written over the ``dsv4`` ops.

``config``      hyperparameters (DSV4-Flash defaults, small test configs) and cache sizes
``rope``        interleaved RoPE with DSV4's YaRN blend; the ``[max_pos, 64]`` tables
``linear``      the GEMMs in bf16 / float32 outputs, and both from one stacked weight
``metadata``    the per-step metadata builder (slots, window and block indices, compressor plans)
``compressor``  gated softmax pooling of ratio-4 (overlapping) / ratio-128 blocks
``indexer``     the lightning indexer of ratio-4 layers (top-k compressed blocks)
``attention``   ``DeepseekV4Attention``: one layer, ``compress_ratio`` in {0, 4, 128}
``model``       a small multi-layer model with random weights
``parallel``    tensor parallelism over ``torch.distributed`` (heads split, outputs all-reduced)

Step inputs and greedy generation (re-exported here) are in :mod:`dsv4_compile.generation`.
"""

from .attention import DeepseekV4Attention
from .compressor import Compressor
from .config import CacheConfig, DeepseekV4Config, tiny_config
from .indexer import Indexer
from .metadata import CompressPlan, StepMetadata, build_step_metadata
from ..generation import decode_inputs, generate, prefill_chunks, prefill_inputs, prefill_prompts, step_inputs
from .model import DeepseekV4Model
from .parallel import TensorParallel
from .rope import apply_rope, layer_rope_table, rope_table

__all__ = [
    "CacheConfig",
    "CompressPlan",
    "Compressor",
    "DeepseekV4Attention",
    "DeepseekV4Config",
    "DeepseekV4Model",
    "Indexer",
    "StepMetadata",
    "TensorParallel",
    "apply_rope",
    "build_step_metadata",
    "decode_inputs",
    "generate",
    "layer_rope_table",
    "prefill_chunks",
    "prefill_inputs",
    "prefill_prompts",
    "rope_table",
    "step_inputs",
    "tiny_config",
]
