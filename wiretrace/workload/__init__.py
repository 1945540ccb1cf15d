"""The analytical workload: which tensors each parallelism exchanges, with whom, and when.

``build_collectives(plan)`` returns the collectives table of one training iteration;
``iteration_estimate(plan)`` the compute / bubble / exposed-communication estimate behind its
``t_ready_ns`` column.
"""

from .estimate import iteration_estimate
from .groups import Groups, build_groups, rank_groups
from .schedule import Workload, build_collectives

__all__ = ["build_collectives", "iteration_estimate", "Workload", "Groups", "build_groups", "rank_groups"]
