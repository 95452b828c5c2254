"""Rank 0's evaluation and progress lines: the test split's loss and accuracy after an
iteration (off both clocks), the warning when a run is not learning, and the progress line.
:class:`Evaluation` is a part of :class:`~.server.ParameterServer` (its ``config``,
``replica``, ``dataset``, ``clock``, ``log``, ``script``, ``bytes_total``)."""

from __future__ import annotations

import torch

from ...config import RunConfig
from ...units import format_elapsed
from ..measure.record import IterationRecord

__all__ = ["Evaluation", "NOT_LEARNING_AFTER", "not_learning_warning", "evaluate"]


class Evaluation:
    """Rank 0's evaluations and progress lines. State: the last evaluation (``last_eval``:
    iteration, test loss, accuracy) and whether the not-learning warning was given."""

    last_eval: tuple[int, float, float] | None = None
    warned_not_learning = False

    def evaluate(self, m: int) -> dict:
        clocks = self.clock.clocks
        clocks.pause()
        test_loss, accuracy = evaluate(self.replica, self.dataset, self.config)
        clocks.resume()
        self.last_eval = (m, test_loss, accuracy)
        warning = not_learning_warning(m, accuracy, self.dataset.num_classes, self.config)
        if warning and not self.warned_not_learning:
            self.warned_not_learning = True
            self.log(warning)
        return dict(iteration=m, wall_time=clocks.now_wall(), sim_time=clocks.sim,
                    test_loss=test_loss, test_accuracy=accuracy)

    def progress_line(self, record: IterationRecord) -> str:
        config = self.config
        done = record.iteration + 1
        eta = (config.iterations - done) * self._mean_iteration_seconds(done)
        acc = f"  acc {self.last_eval[2]:.3f} @{self.last_eval[0] + 1}" if self.last_eval else ""
        # bits 0: a codec without a width (a plugin's top-k, mcgq's sampling): nothing to show
        bits = f"bits {record.bits[0]}  " if record.bits[0] else ""
        bits += f"lr {record.lr:.3g}  " if record.lr is not None else ""
        # the loss as the trace's loss column has it: with the paper's l2 term only where the
        # loss carried one (not with the optimizer's decay, nor for a script's own loss)
        loss = "loss+l2" if config.loss_weight_decay > 0 and not self.script else "loss"
        return (f"iter {done:>{len(str(config.iterations))}}/{config.iterations}  {loss} {record.loss:.4f}  "
                f"{bits}sent {self.bytes_total / 1e6:.1f} MB  sim {format_elapsed(record.sim_time)}  "
                f"wall {format_elapsed(self.clock.clocks.now_wall())}  ETA {format_elapsed(eta)}{acc}")



#: The evaluations that may say a run is not learning: from this many iterations on, and
#: from this share of the run on (a slow start is not a divergence).
NOT_LEARNING_AFTER = (100, 0.25)


def not_learning_warning(m: int, accuracy: float, classes: int, config: RunConfig) -> str | None:
    """A warning line where the test accuracy measured after iteration ``m`` is at chance
    (below 1.5 / ``classes``) once the run is past ``NOT_LEARNING_AFTER``: a rate too high
    for the codec and the data (the paper's lr 0.2 with 2-bit gradients on the 8x8 digits)
    diverges to chance with a loss that looks merely slow; None otherwise."""
    done = m + 1
    iterations, share = NOT_LEARNING_AFTER
    if done < iterations or done < share * config.iterations or accuracy >= 1.5 / classes:
        return None
    return (f"mpigrad: warning: test accuracy {accuracy:.3f} after iteration {done} is chance level "
            f"({classes} classes): the run is not learning; a lower --lr may help (lr {config.lr:g})")


@torch.no_grad()
def evaluate(replica, dataset, config: RunConfig, batch: int = 256) -> tuple[float, float]:
    """Test loss (cross-entropy, no l2 term) and accuracy of the replica on the test split."""
    model = replica.model
    model.eval()
    n = len(dataset.test_y) if config.eval_samples is None else min(config.eval_samples, len(dataset.test_y))
    total_loss, correct = 0.0, 0
    for start in range(0, n, batch):
        x = torch.from_numpy(dataset.test_x[start:min(start + batch, n)]).to(replica.device)
        y = torch.from_numpy(dataset.test_y[start:min(start + batch, n)]).to(replica.device)
        logits = model(x)
        total_loss += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
    model.train()
    return total_loss / n, correct / n
