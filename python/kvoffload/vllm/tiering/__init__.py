"""Our secondary tiers inside vLLM's own tiering (`TieringOffloadingSpec`'s `secondary_tiers`,
`module_path: kvoffload.vllm`): `RedisTier` and `DiskTier`, on what `chunk_tier` shares."""

from kvoffload.vllm.tiering.disk import DiskTier
from kvoffload.vllm.tiering.redis import RedisTier

__all__ = ["DiskTier", "RedisTier"]
