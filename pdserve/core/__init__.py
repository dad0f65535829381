"""Pure-Python scheduling core: requests, sampling parameters, the scheduler and KV block bookkeeping.

Never imports torch (a test enforces it), so the simulator and the gateway can use it without the model.
"""

from pdserve.core.block_manager import BlockId, KVBlockManager, PrefixHit
from pdserve.core.request import Request, RequestStatus
from pdserve.core.sampling_params import SamplingParams
from pdserve.core.schedule import ExecutorOutput, ScheduledChunk, SchedulerConfig, SchedulerOutput
from pdserve.core.scheduler import Scheduler

__all__ = ["BlockId", "ExecutorOutput", "KVBlockManager", "PrefixHit", "Request", "RequestStatus",
           "SamplingParams", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
