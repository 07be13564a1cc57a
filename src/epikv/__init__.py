"""epikv: attention-free KV cache eviction for long reasoning traces (EPIKV, arXiv:2606.26472)."""

from .cache import EpiKVCache
from .engine import Decoder, GenerationResult, Sampling, generate
from .errors import EpiKVError
from .models import load_model
from .policies import REGISTRY, Policy, get_policy, policy_names, register_policy
from .press import Press, press

__version__ = "0.1.0"

__all__ = ["Decoder", "EpiKVCache", "EpiKVError", "GenerationResult", "Policy", "Press", "REGISTRY", "Sampling",
           "generate", "get_policy", "load_model", "policy_names", "press", "register_policy"]
