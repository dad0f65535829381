"""Pure-Python scheduling core: requests, sampling parameters, the scheduler and KV block bookkeeping.

Never imports torch (a test enforces it), so the simulator and the gateway can use it without the model.
Grouped by concern: `sched` (an engine's step scheduler and its policies), `kvstore` (blocks, tiers, metadata,
codecs), `pd` (disaggregation's decisions); requests, sampling parameters, settings, service tiers and the role
planner at the top. The flat names of before (`pdserve.core.scheduler`, ...) still import, as the same modules
(`pdserve.core._aliases`).
"""

from pdserve.core import _aliases

_aliases.install()

from pdserve.core.kvstore.block_manager import BlockId, KVBlockManager, PrefixHit
from pdserve.core.request import Request, RequestStatus
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.sched.schedule import ExecutorOutput, ScheduledChunk, SchedulerConfig, SchedulerOutput
from pdserve.core.sched.scheduler import Scheduler

__all__ = ["BlockId", "ExecutorOutput", "KVBlockManager", "PrefixHit", "Request", "RequestStatus",
           "SamplingParams", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
