"""`--executor ray`: batches spread over a Ray cluster with a dynamic queue.

One actor per worker loads the model once; the driver keeps every actor busy (a new batch as soon as one returns,
since trace lengths vary ten-fold) and writes the records itself, exactly as the local executor does. Ray is an
optional extra: `pip install epikv[ray]`."""

from __future__ import annotations

from pathlib import Path

from ..errors import EpiKVError
from .records import open_store
from .runner import Plan, Progress, claim_batch, run_batch


class _Worker:
    def __init__(self, spec, problems, worker_id: str):
        import os

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from ..models import load_model

        if spec.threads:
            import torch

            torch.set_num_threads(spec.threads)

        self.spec, self.problems, self.worker_id = spec, problems, worker_id
        self.lm = load_model(spec.model, **spec.model_kwargs)

    def run(self, batch):
        return run_batch(self.lm, self.spec, self.problems, batch, executor="ray", worker=self.worker_id)


def run_ray(plan: Plan, records_path: Path, workers: int | None = None, address: str | None = None,
            gpus_per_worker: float = 0.0, cpus_per_worker: float = 1.0, quiet: bool = False) -> int:
    try:
        import ray
    except ImportError:
        raise EpiKVError("--executor ray needs Ray: pip install 'epikv[ray]' (or pip install ray)") from None
    if not plan.batches:
        return 0
    started = False
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        started = True
    try:
        if workers is None:
            res = ray.cluster_resources()
            workers = int(res.get("GPU", 0) // gpus_per_worker) if gpus_per_worker else \
                int(res.get("CPU", 1) // cpus_per_worker)
        workers = max(1, min(workers, len(plan.batches)))
        actor = ray.remote(num_cpus=cpus_per_worker, num_gpus=gpus_per_worker)(_Worker)
        problems_ref = ray.put(plan.problems)
        pool = [actor.remote(plan.spec, problems_ref, str(i)) for i in range(workers)]
        queue = list(plan.batches)
        bar = Progress(plan.n_cells, quiet, done=plan.n_done)
        running = {}
        n = 0
        with open_store(records_path.parent, records_path.name) as store:

            def next_batch():  # the next batch's cells not finished or claimed by another process
                while queue:
                    b = queue.pop(0)
                    mine = claim_batch(store, b)
                    if mine is None or len(mine.ids) < len(b.ids):
                        bar.skip(len(b.ids) - (len(mine.ids) if mine else 0))
                    if mine is not None:
                        return mine
                return None

            for a in pool:  # fill every worker, then refill whichever finishes first
                b = next_batch()
                if b is not None:
                    running[a.run.remote(b)] = (a, b)
            while running:
                ready, _ = ray.wait(list(running), num_returns=1)
                a, b = running.pop(ready[0])
                recs = ray.get(ready[0])
                bar.start(b)
                store.append(recs)
                n += len(recs)
                bar.update(recs)
                nb = next_batch()
                if nb is not None:
                    running[a.run.remote(nb)] = (a, nb)
        bar.close()
        for a in pool:
            ray.kill(a)
        return n
    finally:
        if started:
            ray.shutdown()
