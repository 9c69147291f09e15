"""The errors a training step raises, and the loss guards (train.max_loss, train.loss_spike_factor) that
stop a run on purpose: every rank decides on the all-reduced loss, so all stop at the same step."""

from __future__ import annotations

from spartron.runtime.sections import TrainConfig


class TrainingError(RuntimeError):
    """A step failed on this rank; the message names the rank and the step."""


class LossGuardStop(TrainingError):
    """A loss guard stopped the run on purpose (every rank at the same step, before the optimizer step):
    the launcher reports it as one line naming the step and the value, exit status 2, no traceback."""


class NonFiniteLossError(LossGuardStop):
    """The (all-reduced) loss or gradient norm is NaN or Inf."""


class LossSpikeError(LossGuardStop):
    """The (all-reduced, finite) loss is above train.max_loss or train.loss_spike_factor x the first loss."""


def check_loss_limits(t: TrainConfig, step: int, loss: float, first_loss: float | None) -> None:
    """train.max_loss / train.loss_spike_factor: an exploding (still finite) loss stops the run at its step."""
    if t.max_loss is not None and loss > t.max_loss:
        raise LossSpikeError(f"loss {loss:.6g} at step {step} is above train.max_loss = {t.max_loss:g}")
    if t.loss_spike_factor and first_loss is not None and first_loss > 0 \
            and loss > t.loss_spike_factor * first_loss:
        raise LossSpikeError(f"loss {loss:.6g} at step {step} is {loss / first_loss:.3g}x the first step's loss "
                             f"{first_loss:.6g}, above train.loss_spike_factor = {t.loss_spike_factor:g} "
                             "(lower train.lr, or set train.loss_spike_factor = 0 to train on)")
