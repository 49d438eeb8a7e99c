"""Independent float64 NumPy implementation of Algorithm 1, written from the paper.

Nothing here imports cbp_optax or JAX: these are the numbers the library is
checked against. Blocks are lists of arrays (a layer's kernel and bias, say);
parameters are a list of blocks, and the optimizer is built from their shapes.
"""

from __future__ import annotations

import numpy as np


def scales_from_energy(q, t, s_min, s_max):
  """Eq. (6) from the energies stored through step t-1; ones at t = 1."""
  if t == 1:
    return np.ones_like(q)
  c = np.sqrt(np.mean(q))
  with np.errstate(divide='ignore'):
    ratio = np.where(q > 0, c / np.sqrt(np.where(q > 0, q, 1.0)), np.inf)
  return np.clip(ratio, s_min, s_max)


class CBPReference:
  """Algorithm 1, steps 3-9 (M1 + M3 with bias-corrected momentum)."""

  def __init__(self, shapes, *, lr, b1=0.9, b2=0.999, damping=1e-3,
               rho=0.99, s_min=0.1, s_max=4.0, equalize=True,
               precondition=True, relative_damping=0.0, equalized=None,
               normalized_first_step=False, update_clip=None):
    """``relative_damping`` (delta), ``equalized`` (which blocks M1 scales;
    the others keep s = 1 and are not in the target c) and
    ``normalized_first_step`` are the opt-in extensions: damping + delta *
    sqrt(mean(v_hat)) per array, M1 over a subset of the blocks, and v_hat
    replaced by the current g~^2 where the stored v is zero (all of step 1)
    instead of P_1 = I; ``update_clip`` (c) clips each coordinate of
    P_t m_hat_t to [-c, c]."""
    self.lr, self.b1, self.b2, self.damping = lr, b1, b2, damping
    self.relative_damping = relative_damping
    self.normalized_first_step = normalized_first_step
    self.update_clip = update_clip
    self.equalized = (np.ones(len(shapes), bool) if equalized is None
                      else np.asarray(equalized, bool))
    self.rho, self.s_min, self.s_max = rho, s_min, s_max
    self.equalize, self.precondition = equalize, precondition
    self.t = 0
    self.q = np.zeros(len(shapes))
    self.m = [[np.zeros(shape) for shape in block] for block in shapes]
    self.v = [[np.zeros(shape) for shape in block] for block in shapes]
    self.last_scales = None
    self.last_operator = None  # M_t = P_t S_t per coordinate (for b1 = 0).

  def direction(self, grads):
    """The update direction P_t m_hat_t of step t (before the learning rate)."""
    self.t += 1
    t = self.t
    if self.equalize:
      s = np.ones(len(grads))
      on = self.equalized
      s[on] = scales_from_energy(self.q[on], t, self.s_min, self.s_max)  # 3
      energies = np.array([sum(np.sum(g.astype(np.float64) ** 2) for g in b)
                           for b in grads])
      self.q = self.rho * self.q + (1 - self.rho) * energies        # step 4
    else:
      s = np.ones(len(grads))
    self.last_scales = s
    directions, operators = [], []
    for l, block in enumerate(grads):
      block_dirs, block_ops = [], []
      for i, g in enumerate(block):
        g_eq = s[l] * g.astype(np.float64)                         # step 5
        m = self.b1 * self.m[l][i] + (1 - self.b1) * g_eq           # step 6
        self.m[l][i] = m
        m_hat = m / (1 - self.b1 ** t)
        if self.precondition:
          v_prev = self.v[l][i]
          if t == 1 and not self.normalized_first_step:
            p = np.ones_like(m)                                     # P_1 = I
          else:
            if t == 1:
              v_hat = np.zeros_like(m)
            else:
              v_hat = v_prev / (1 - self.b2 ** (t - 1))             # step 7
            if self.normalized_first_step:
              v_hat = np.where(v_prev == 0, g_eq ** 2, v_hat)
            damping = (self.damping + self.relative_damping
                       * np.sqrt(np.mean(v_hat)))
            p = 1.0 / (np.sqrt(v_hat) + damping)
          self.v[l][i] = (self.b2 * self.v[l][i]
                          + (1 - self.b2) * g_eq ** 2)              # step 9
        else:
          p = np.ones_like(m)
        direction = p * m_hat
        if self.update_clip is not None:
          direction = np.clip(direction, -self.update_clip, self.update_clip)
        block_dirs.append(direction)
        block_ops.append(p * s[l])
      directions.append(block_dirs)
      operators.append(block_ops)
    self.last_operator = operators
    return directions

  def step(self, params, grads):
    """theta_{t+1} = theta_t - lr P_t m_hat_t (step 8)."""
    directions = self.direction(grads)
    return [[p - self.lr * d for p, d in zip(pb, db)]
            for pb, db in zip(params, directions)]


def gradient_sequence(rng, shapes, steps, block_scales):
  """Gradients whose blocks differ by the given orders of magnitude."""
  seq = []
  for t in range(steps):
    wobble = 1.0 + 0.5 * np.sin(0.7 * t + np.arange(len(shapes)))
    seq.append([
        [scale * w * rng.standard_normal(shape) for shape in block]
        for block, scale, w in zip(shapes, block_scales, wobble)
    ])
  return seq


class CenteredMLPReference:
  """A ReLU MLP with every layer centered (eq. 8), hand-written backprop, the
  full CBP update and the mean refresh with bias transport (Algorithm 1,
  steps 1-11). Kernels are (in, out) as in Flax; the loss is the mean softmax
  cross-entropy."""

  def __init__(self, kernels, biases, *, lr, rho, **cbp_kwargs):
    self.kernels = [np.array(k, np.float64) for k in kernels]
    self.biases = [np.array(b, np.float64) for b in biases]
    self.means = [np.zeros(k.shape[0]) for k in self.kernels]
    self.rho = rho
    self.optimizer = CBPReference(
        [[k.shape, b.shape] for k, b in zip(self.kernels, self.biases)],
        lr=lr, rho=rho, **cbp_kwargs)

  def loss_and_grads(self, x, labels):
    activations, centered, pre = [np.asarray(x, np.float64)], [], []
    for l, (k, b) in enumerate(zip(self.kernels, self.biases)):
      c = activations[-1] - self.means[l]                        # eq. (8)
      z = c @ k + b
      centered.append(c)
      pre.append(z)
      if l < len(self.kernels) - 1:
        activations.append(np.maximum(z, 0.0))
    logits = pre[-1]
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    n = logits.shape[0]
    loss = -np.mean(np.log(probs[np.arange(n), labels]))
    delta = probs.copy()
    delta[np.arange(n), labels] -= 1.0
    delta /= n
    grads = [None] * len(self.kernels)
    for l in reversed(range(len(self.kernels))):
      grads[l] = [centered[l].T @ delta, delta.sum(axis=0)]      # eq. (9)
      if l > 0:
        delta = (delta @ self.kernels[l].T) * (pre[l - 1] > 0)
    batch_means = [a.mean(axis=0) for a in activations]
    return loss, grads, batch_means

  def step(self, x, labels):
    loss, grads, batch_means = self.loss_and_grads(x, labels)
    params = [[k, b] for k, b in zip(self.kernels, self.biases)]
    params = self.optimizer.step(params, grads)                   # steps 3-9
    self.kernels = [p[0] for p in params]
    self.biases = [p[1] for p in params]
    for l in range(len(self.kernels)):
      new = self.rho * self.means[l] + (1 - self.rho) * batch_means[l]  # 10
      self.biases[l] = self.biases[l] + (new - self.means[l]) @ self.kernels[l]
      self.means[l] = new                                         # step 11
    return loss
