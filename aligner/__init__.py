"""aligner: alignment algorithms (SFT, reward models, DPO, PPO, REINFORCE, SPIN, SteerLM) on megatron-core."""
from aligner.runtime.distributed import silence_third_party_notices as _silence_third_party_notices

# Before any module of the package can import megatron-core, which raises some of them at import.
_silence_third_party_notices()
