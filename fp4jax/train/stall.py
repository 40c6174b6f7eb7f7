"""Runs that stopped learning: loss flat at the uniform value, or no gradient.

A collapsed model (after a learning rate far too high, say) predicts the
uniform distribution, loss ln(vocab_size), and its gradient can be exactly
0: training goes on but nothing is learnt. `StallWatch` is fed each step's
loss and gradient norm and reports, once, a window of WINDOW steps in a row
whose loss lies within TOLERANCE nats of ln(vocab_size) (counted only after
the warm-up, while the loss of a fresh model is still near it) or whose
gradient norm is exactly 0.
"""

import math

WINDOW = 20
TOLERANCE = 0.01


class StallWatch:
  """Counts stalled steps in a row; `found` holds the first stall, in words."""

  def __init__(self, vocab_size, *, after_step=0, window=None):
    self.uniform = math.log(vocab_size)
    self.after_step, self.window = after_step, window or WINDOW
    self._flat = self._zero = 0
    self.found = None

  def update(self, step, loss, grad_norm):
    """Takes step `step`'s loss and grad norm; returns a warning line when a
    stall is first found, else None."""
    flat = step > self.after_step and abs(loss - self.uniform) < TOLERANCE
    self._flat = self._flat + 1 if flat else 0
    self._zero = self._zero + 1 if grad_norm == 0.0 else 0
    if self.found is not None or max(self._flat, self._zero) < self.window:
      return None
    what = ("the gradient norm was exactly 0" if self._zero >= self.window
            else f"the loss stayed at ln(vocab_size) = {self.uniform:.4f} "
            "(a uniform prediction)")
    self.found = (f"stopped learning: {what} for {self.window} steps in a row "
                  f"(steps {step - self.window + 1}-{step})")
    return (f"fp4jax: warning: the run {self.found}; the model has probably "
            "collapsed (e.g. a learning rate too high). Training goes on; "
            "summary.json's status will be \"stalled\".")
