"""A connector that records every call: what TensorRT-LLM's connector tests use MagicMocks for.

``tests/integration/defs/llmapi/test_llm_api_connector.py`` patches the executor's
``importlib`` so that both connector classes are ``MagicMock`` s, configures return values
(``scheduler.get_num_new_matched_tokens.return_value = 16, True``) and then asserts on
``call_count`` / ``call_args_list``. :class:`RecordingConnector` gives the same surface with
real subclasses of the connector ABCs, so the emulator's scenario tests read like the
originals::

    rec = RecordingConnector()
    rec.scheduler.get_num_new_matched_tokens.return_value = (16, True)
    rec.worker.get_finished.side_effect = echo_finished
    scheduler_cls, worker_cls = rec.classes()
    executor = PyExecutorEmulator(args, model, num_blocks=64,
                                  connector_scheduler_cls=scheduler_cls,
                                  connector_worker_cls=worker_cls)
    executor.generate([prompt], 8)
    assert rec.worker.start_load_kv.call_count == 8

:attr:`RecordingConnector.log` keeps every call of both roles in order, for call-order
assertions. Under TP each rank records in its own process (the scheduler only on rank 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

from s3kv.connector.api import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    SchedulerOutput,
)


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded call (``call.args`` as in ``unittest.mock``)."""

    args: tuple[Any, ...]


class RecordedMethod:
    """A recording stand-in for one method: ``return_value``, ``side_effect``, calls."""

    def __init__(self, name: str, log: list[tuple[str, tuple[Any, ...]]], default: Any) -> None:
        self.name = name
        self.return_value: Any = default
        self.side_effect: Callable[..., Any] | None = None
        self.call_args_list: list[Call] = []
        self._log = log

    def __call__(self, *args: Any) -> Any:
        self.call_args_list.append(Call(args))
        self._log.append((self.name, args))
        if self.side_effect is not None:
            return self.side_effect(*args)
        return self.return_value

    @property
    def call_count(self) -> int:
        """Calls so far."""
        return len(self.call_args_list)

    @property
    def call_args(self) -> Call:
        """The last call.

        Raises:
            AssertionError: Never called.
        """
        if not self.call_args_list:
            raise AssertionError(f"{self.name} was never called")
        return self.call_args_list[-1]

    def reset_mock(self) -> None:
        """Forget the calls (configuration stays, as with ``MagicMock.reset_mock``)."""
        self.call_args_list.clear()


class SchedulerCalls:
    """The scheduler's recorded methods, with TensorRT-LLM-test-like defaults."""

    def __init__(self, log: list[tuple[str, tuple[Any, ...]]]) -> None:
        self.build_connector_meta = RecordedMethod("build_connector_meta", log, None)
        self.get_num_new_matched_tokens = RecordedMethod(
            "get_num_new_matched_tokens", log, (0, False)
        )
        self.request_finished = RecordedMethod("request_finished", log, False)
        self.update_state_after_alloc = RecordedMethod("update_state_after_alloc", log, None)
        self.wait_for_initialization = RecordedMethod("wait_for_initialization", log, None)


class WorkerCalls:
    """The worker's recorded methods (``forward_pass`` is the registered callable)."""

    def __init__(self, log: list[tuple[str, tuple[Any, ...]]]) -> None:
        self.register_kv_caches = RecordedMethod("register_kv_caches", log, None)
        self.bind_connector_meta = RecordedMethod("bind_connector_meta", log, None)
        self.start_load_kv = RecordedMethod("start_load_kv", log, None)
        self.wait_for_layer_load = RecordedMethod("wait_for_layer_load", log, None)
        self.save_kv_layer = RecordedMethod("save_kv_layer", log, None)
        self.wait_for_save = RecordedMethod("wait_for_save", log, None)
        self.get_finished = RecordedMethod("get_finished", log, ([], []))
        self.forward_pass = RecordedMethod("forward_pass", log, None)


def echo_finished(
    finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
) -> tuple[list[int], list[int]]:
    """A ``get_finished`` that finishes everything at once (the upstream tests' lambda)."""
    return list(finished_gen_req_ids), list(started_loading_req_ids)


class RecordingConnector:
    """Shared configuration and records for one scheduler/worker class pair."""

    def __init__(self, *, provide_forward_pass_callable: bool = True) -> None:
        self.log: list[tuple[str, tuple[Any, ...]]] = []
        self.scheduler = SchedulerCalls(self.log)
        self.worker = WorkerCalls(self.log)
        self.provide_forward_pass_callable = provide_forward_pass_callable
        self.constructed: list[tuple[str, Any]] = []  # (role, llm_args) per instance

    def classes(
        self,
    ) -> tuple[type[KvCacheConnectorScheduler], type[KvCacheConnectorWorker]]:
        """``(scheduler_cls, worker_cls)`` bound to this recorder."""
        scheduler = type("RecordingScheduler", (RecordingScheduler,), {"recorder": self})
        worker = type("RecordingWorker", (RecordingWorker,), {"recorder": self})
        return scheduler, worker

    def names(self) -> list[str]:
        """Method names in call order, both roles."""
        return [name for name, _ in self.log]

    def scheduler_outputs(self) -> list[SchedulerOutput]:
        """Every ``SchedulerOutput`` passed to ``build_connector_meta``, in order."""
        return [call.args[0] for call in self.scheduler.build_connector_meta.call_args_list]


#: Used by the module-level classes below when they are imported by name
#: (``KvCacheConnectorConfig("s3kv.testing.emulator.recording", "RecordingScheduler", ...)``).
DEFAULT = RecordingConnector()


class RecordingScheduler(KvCacheConnectorScheduler):
    """A scheduler that records each call and answers from its recorder's configuration."""

    recorder: ClassVar[RecordingConnector | None] = None

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._rec = type(self).recorder or DEFAULT
        self._rec.constructed.append(("scheduler", llm_args))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        return self._rec.scheduler.build_connector_meta(scheduler_output)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        num, load_async = self._rec.scheduler.get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        return int(num), bool(load_async)

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return bool(self._rec.scheduler.request_finished(request, cache_block_ids))

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        self._rec.scheduler.update_state_after_alloc(request, block_ids)

    def wait_for_initialization(self) -> None:
        self._rec.scheduler.wait_for_initialization()


class RecordingWorker(KvCacheConnectorWorker):
    """A worker that records each call and answers from its recorder's configuration."""

    recorder: ClassVar[RecordingConnector | None] = None

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._rec = type(self).recorder or DEFAULT
        self._rec.constructed.append(("worker", llm_args))

    def register_forward_pass_callable(self) -> Callable[[], None] | None:
        return self._rec.worker.forward_pass if self._rec.provide_forward_pass_callable else None

    def bind_connector_meta(self, metadata: object) -> None:
        self._rec.worker.bind_connector_meta(metadata)
        super().bind_connector_meta(metadata)

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        self._rec.worker.register_kv_caches(kv_cache_tensor)

    def start_load_kv(self, stream: Any) -> None:
        self._rec.worker.start_load_kv(stream)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        self._rec.worker.wait_for_layer_load(layer_idx, stream)

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        self._rec.worker.save_kv_layer(layer_idx, stream)

    def wait_for_save(self, stream: Any) -> None:
        self._rec.worker.wait_for_save(stream)

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        saved, loaded = self._rec.worker.get_finished(
            list(finished_gen_req_ids), list(started_loading_req_ids)
        )
        return list(saved), list(loaded)


__all__ = [
    "DEFAULT",
    "Call",
    "RecordedMethod",
    "RecordingConnector",
    "RecordingScheduler",
    "RecordingWorker",
    "SchedulerCalls",
    "WorkerCalls",
    "echo_finished",
]
