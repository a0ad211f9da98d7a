"""Codec processes: block GET/PUT and codec work beside the engine's interpreter. Import here.

Parts (users import this front, never the parts):

* ``jobs`` — :class:`FetchJob`, :class:`SaveJob`, :class:`SaveJobs` (many saves, column by
  column), :class:`Outcome` and :class:`Outcomes` (many outcomes): what crosses between a
  store and its processes (builtins; block bytes stay in shared memory).
* ``processes`` — :class:`CodecProcesses`, the store's side: starts the processes, batches
  jobs to them, delivers outcomes, and survives their death.
* ``child`` — the process itself (``python -m s3kv.offload.child FD``).
* ``affinity`` — which CPUs the processes run on (``codec_cpus``): :func:`choose_cpus`.
* ``sizing`` — how many processes ``codec_processes = auto`` runs per store:
  :func:`resolve_codec_processes` (the connector calls it; a store takes a number).
* ``work`` — one job's work, and :func:`open_stored`, the one way a stored block is opened
  (the store's in-thread path uses it too).

A store uses them when ``codec_processes`` > 0 (:mod:`s3kv.store`); ``auto`` is resolved by
the connector, which knows whether the KV cache is on a GPU.
"""

from s3kv.offload.affinity import Placement, choose_cpus, log_placement
from s3kv.offload.jobs import Failure, FetchJob, Job, Outcome, Outcomes, SaveJob, SaveJobs
from s3kv.offload.processes import CodecProcesses
from s3kv.offload.sizing import AutoChoice, auto_here, resolve_codec_processes
from s3kv.offload.work import open_stored

__all__ = [
    "AutoChoice",
    "CodecProcesses",
    "Failure",
    "FetchJob",
    "Job",
    "Outcome",
    "Outcomes",
    "Placement",
    "SaveJob",
    "SaveJobs",
    "auto_here",
    "choose_cpus",
    "log_placement",
    "open_stored",
    "resolve_codec_processes",
]
