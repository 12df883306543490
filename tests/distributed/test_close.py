"""close() is idempotent and never raises on a broken tensor-parallel group."""

from __future__ import annotations

from checkpoints import cached_checkpoint

from replayssm import LLM
from replayssm.distributed import group as tp_group
from replayssm.distributed.runner import TPModelRunner

ENGINE = dict(device="cpu", dtype="float32", replay_window=4, kv_block_size=4, num_kv_blocks=32,
              num_slots=4, max_num_seqs=2, max_num_batched_tokens=24, max_model_len=64)


class _Exited:
    """A spawned worker process that has exited."""

    exitcode = -9

    def join(self, timeout=None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


def test_release_on_a_broken_group_shuts_it_down_without_raising(monkeypatch):
    """A runner's close() on a group with a dead worker raises nothing, twice, and drops the group."""
    # The fake group's shutdown destroys this process's default group: first shut down an idle real
    # group an earlier test may have left for reuse, so monkeypatch does not restore a destroyed one.
    tp_group.shutdown()
    group = tp_group.TPGroup(2, "cpu", control=None, processes=[_Exited()])
    monkeypatch.setattr(tp_group, "_GROUP", group)
    runner = object.__new__(TPModelRunner)  # the runner's state without loading a model
    runner.group, runner.local = group, None
    group.owner = runner
    runner.close()
    runner.close()
    assert group.owner is None and tp_group._GROUP is None and runner.group is None


def test_close_twice_after_a_worker_died():
    """A real TP=2 LLM whose worker was killed closes twice without raising; the next group is fresh."""
    llm = LLM(cached_checkpoint("nemotron_h", n_groups=2)[0], **ENGINE, tensor_parallel_size=2)
    group = tp_group._GROUP
    group.processes[0].kill()
    group.processes[0].join(timeout=30)
    llm.close()
    llm.close()
    assert tp_group._GROUP is None


def test_offline_llm_close_is_idempotent(tmp_path):
    """LLM.close() and LLMEngine.close() may be called again (and by a `with` exit) without error."""
    from replayssm.demo import demo_checkpoint

    with LLM(demo_checkpoint(cache_dir=str(tmp_path)), device="cpu", max_model_len=64) as llm:
        llm.close()
        llm.engine.close()
    llm.close()
