"""aligner: alignment algorithms (SFT, reward models, DPO, PPO, REINFORCE, SPIN, SteerLM) on megatron-core."""
from aligner.runtime import lazy_compile as _lazy_compile
from aligner.runtime.distributed import silence_third_party_notices as _silence_third_party_notices

# Before any module of the package can import megatron-core, which raises some of its notices and
# decorates its fusion functions with torch.compile at import.
_lazy_compile.install()
_silence_third_party_notices()
