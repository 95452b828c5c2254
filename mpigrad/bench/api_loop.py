"""``mpigrad train``'s recipe written as a script's own loop over :class:`mpigrad.Session`:
the loop that ``mpigrad bench api`` races against ``mpigrad train`` (docs/api.rst).

Run on every rank: ``mpiexec -n P+1 python -m mpi4py -m mpigrad.bench.api_loop CONFIG.toml``.
It reads the whole config (``RunConfig.from_sources``) for what the script owns (model, data,
batch size, rate, optimizer, schedule, augmentation, precision) and builds them as train's
workers do: the model from the seed, each worker's shard of batches (train's
:class:`~mpigrad.runtime.run.recipe.Recipe`), the optimizer by name over the model's parameters,
the rate of each iteration from the schedule.
The Session takes the same file for the method and drops the script's keys. The loop is the
documented one: ``zero_grad``, forward, ``session.backward(loss)``, ``optimizer.step()``.
With plain SGD it computes train's numbers, so the bench also compares the losses.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m mpi4py -m mpigrad.bench.api_loop CONFIG.toml", file=sys.stderr)
        return 2
    (config_file,) = argv
    import mpigrad
    from mpigrad.config import RunConfig
    from mpigrad.optim import LearningRate, build_torch_optimizer
    from mpigrad.runtime.exchange.build import build_config_model, forward_context, load_data
    from mpigrad.runtime.plan.gpu import resolve_device
    from mpigrad.runtime.run.recipe import Recipe

    recipe = RunConfig.from_sources(config_file, {})
    dataset = load_data(recipe)
    device = resolve_device(recipe.device)
    model = build_config_model(recipe, dataset).to(device)
    optimizer = build_torch_optimizer(recipe.optimizer, model.parameters(), recipe.lr, recipe.update_options)
    session = mpigrad.Session(model, config_file, optimizer=optimizer)
    if not session.is_worker:
        return session.serve()

    rate = LearningRate(recipe.lr, recipe.lr_schedule, recipe.lr_schedule_opts, recipe.lr_warmup,
                        recipe.lr_scaling, session.workers)
    data = Recipe(recipe, session.worker_index + 1, session.workers)
    for m in range(session.iterations):
        x, y = data.batch(m, device)
        for group in optimizer.param_groups:
            group["lr"] = rate.at(m)
        optimizer.zero_grad()
        with forward_context(recipe, device):
            loss = model.loss(model(x), y, recipe.loss_weight_decay)
        session.backward(loss)
        optimizer.step()
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
