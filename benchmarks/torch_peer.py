"""The paper's framework beside ours: a straightforward PyTorch CBP on CPU.

Optional (``pip install torch==2.13.0`` installs the CPU wheel); never a
dependency of the library or its tests. It follows the paper's description
(§6.6: "a stand-alone optimizer plus centered layer modules realizing (8) and
the transport (10)"), written per tensor and unfused, as the paper timed it:

* :class:`CenteredLinear`, :class:`CenteredConv2d`: ``z = W (a - mu) + b``;
  the forward pass records the batch mean of the input; :meth:`transport`
  moves ``mu`` by an EMA and the bias by ``W (mu_new - mu_old)``. The
  convolution pads explicitly, centers, then convolves unpadded.
* :class:`CBP`: M1 (block energies from the previous step, clip [0.1, 4])
  and M3 (momentum, lagged damped second moment, P_1 = I), Algorithm 1.

Timed like the JAX suite: every variant once per round, interleaved, with
``torch.set_num_threads(2)``; one step is zero_grad, forward, loss, backward,
optimizer step and (for CBP) the transport. ResNet-8 runs channels-last, the
faster layout on CPU.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

try:
  import torch
  from torch import nn
  from torch.nn import functional as F
except ImportError:  # The peer is optional.
  torch = None

THREADS = 2
LR = 1e-3
VARIANTS = ('SGD', 'Adam', 'CBP')

if torch is not None:

  class CenteredLinear(nn.Linear):
    """``z = W (a - mu) + b`` (eq. 8), recording the input's batch mean."""

    def __init__(self, in_features: int, out_features: int):
      super().__init__(in_features, out_features)
      self.register_buffer('mu', torch.zeros(in_features))
      self.register_buffer('batch_mean', torch.zeros(in_features))

    def forward(self, x):
      if self.training:
        self.batch_mean.copy_(x.detach().mean(0))
      return F.linear(x - self.mu, self.weight, self.bias)

    @torch.no_grad()
    def transport(self, rho: float = 0.99) -> None:
      new = rho * self.mu + (1 - rho) * self.batch_mean
      self.bias.add_(self.weight @ (new - self.mu))
      self.mu.copy_(new)

  class CenteredConv2d(nn.Conv2d):
    """A centered convolution: pad, subtract ``mu`` per channel, convolve."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1,
                 padding=0):
      super().__init__(in_channels, out_channels, kernel_size, stride,
                       padding=0)
      self.pad = padding
      self.register_buffer('mu', torch.zeros(in_channels))
      self.register_buffer('batch_mean', torch.zeros(in_channels))

    def forward(self, x):
      if self.training:
        self.batch_mean.copy_(x.detach().mean((0, 2, 3)))
      if self.pad:
        x = F.pad(x, (self.pad,) * 4)
      return super().forward(x - self.mu.view(1, -1, 1, 1))

    @torch.no_grad()
    def transport(self, rho: float = 0.99) -> None:
      new = rho * self.mu + (1 - rho) * self.batch_mean
      self.bias.add_(self.weight.sum((2, 3)) @ (new - self.mu))
      self.mu.copy_(new)

  def _linear(centered: bool):
    return CenteredLinear if centered else nn.Linear

  def _conv(centered: bool, cin, cout, k, stride=1, padding=0):
    cls = CenteredConv2d if centered else nn.Conv2d
    return cls(cin, cout, k, stride, padding=padding)

  class MLP(nn.Module):
    def __init__(self, width: int, centered: bool):
      super().__init__()
      sizes = [784] + [width] * 4 + [10]
      self.layers = nn.ModuleList(
          _linear(centered)(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
      for layer in self.layers[:-1]:
        x = F.relu(layer(x))
      return self.layers[-1](x)

  class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, centered: bool):
      super().__init__()
      self.conv1 = _conv(centered, cin, cout, 3, stride, 1)
      self.conv2 = _conv(centered, cout, cout, 3, 1, 1)
      self.projection = (_conv(centered, cin, cout, 1, stride)
                         if stride != 1 or cin != cout else None)

    def forward(self, x):
      y = self.conv2(F.relu(self.conv1(x)))
      shortcut = x if self.projection is None else self.projection(x)
      return F.relu(y + shortcut)

  class ResNet8(nn.Module):
    def __init__(self, centered: bool):
      super().__init__()
      self.stem = _conv(centered, 3, 16, 3, 1, 1)
      self.blocks = nn.Sequential(BasicBlock(16, 16, 1, centered),
                                  BasicBlock(16, 32, 2, centered),
                                  BasicBlock(32, 64, 2, centered))
      self.head = _linear(centered)(64, 10)

    def forward(self, x):
      x = self.blocks(F.relu(self.stem(x)))
      return self.head(x.mean((2, 3)))

  class CBP(torch.optim.Optimizer):
    """M1 + M3 of Algorithm 1, one parameter group per layer (M1 block)."""

    def __init__(self, blocks: Sequence[Sequence[torch.Tensor]], lr=LR,
                 b1=0.9, b2=0.999, damping=1e-3, rho=0.99, s_min=0.1,
                 s_max=4.0):
      groups = [{'params': list(b)} for b in blocks]
      super().__init__(groups, dict(lr=lr, b1=b1, b2=b2, damping=damping))
      self.rho, self.s_min, self.s_max = rho, s_min, s_max
      dtype = groups[0]['params'][0].dtype if groups else torch.float32
      self.energy = torch.zeros(len(groups), dtype=dtype)
      self.t = 0

    @torch.no_grad()
    def step(self, closure=None):
      self.t += 1
      t = self.t
      if t == 1:
        scales = torch.ones_like(self.energy)
      else:
        target = self.energy.mean().sqrt()
        scales = (target / self.energy.sqrt()).clamp(self.s_min, self.s_max)
      raw = torch.stack([
          sum((p.grad.square().sum() for p in g['params']),
              torch.zeros((), dtype=self.energy.dtype))
          for g in self.param_groups])
      self.energy.mul_(self.rho).add_((1 - self.rho) * raw)
      for scale, group in zip(scales.tolist(), self.param_groups):
        b1, b2 = group['b1'], group['b2']
        for p in group['params']:
          state = self.state[p]
          if not state:
            state['m'] = torch.zeros_like(p)
            state['v'] = torch.zeros_like(p)
          g = p.grad * scale
          m, v = state['m'], state['v']
          m.mul_(b1).add_(g, alpha=1 - b1)
          m_hat = m / (1 - b1 ** t)
          if t == 1:
            update = m_hat
          else:
            denom = (v / (1 - b2 ** (t - 1))).sqrt_().add_(group['damping'])
            update = m_hat.div_(denom)
          v.mul_(b2).addcmul_(g, g, value=1 - b2)
          p.add_(update, alpha=-group['lr'])

  def layer_blocks(model: nn.Module) -> list[list[torch.Tensor]]:
    """One M1 block per layer: the parameters each leaf module owns."""
    return [list(m.parameters(recurse=False)) for m in model.modules()
            if list(m.parameters(recurse=False))]

  def transport(model: nn.Module) -> None:
    for module in model.modules():
      if isinstance(module, (CenteredLinear, CenteredConv2d)):
        module.transport()


def _make_step(arch, variant: str, batch: int) -> Callable[[], None]:
  torch.manual_seed(0)
  centered = variant == 'CBP'
  if arch.kind == 'mlp':
    model = MLP(arch.width, centered)
    x = torch.randn(batch, 784) + 0.5
  else:
    model = ResNet8(centered).to(memory_format=torch.channels_last)
    x = (torch.randn(batch, 3, 32, 32) + 0.5).contiguous(
        memory_format=torch.channels_last)
  y = torch.randint(0, 10, (batch,))
  if variant == 'SGD':
    opt = torch.optim.SGD(model.parameters(), lr=LR)
  elif variant == 'Adam':
    opt = torch.optim.Adam(model.parameters(), lr=LR)
  else:
    opt = CBP(layer_blocks(model))
  model.train()

  def step() -> None:
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    if centered:
      transport(model)

  return step


def run(archs: Iterable, batch: int, rounds: int, warmup: int) -> dict:
  """Interleaved timing of SGD, Adam and CBP per architecture."""
  from benchmarks import timing
  torch.set_num_threads(THREADS)
  groups = []
  for arch in archs:
    print(f'[torch] {arch.name}', flush=True)
    steps = {v: _make_step(arch, v, batch) for v in VARIANTS}
    warm = timing.warm_up(steps, warmup)
    n_rounds, reduced = timing.rounds_for(warm, rounds, min(rounds, 20))
    times = timing.interleaved(steps, n_rounds)
    ratios = timing.pairwise_ratios(times, 'Adam')
    groups.append({
        'arch': arch.name, 'batch': batch, 'rounds': n_rounds,
        'reduced_rounds': reduced,
        'variants': {v: {'time': timing.quartiles(times[v]),
                         'ratio_to_adam': ratios[v]} for v in VARIANTS}})
  return {'version': torch.__version__, 'threads': THREADS,
          'variants': list(VARIANTS), 'groups': groups}


def _check_transport_exact() -> float:
  """Max output change of a centered ResNet-8 across one transport."""
  model = ResNet8(centered=True).double()
  x = torch.randn(4, 3, 32, 32, dtype=torch.float64) + 0.5
  model.train()
  model(x)
  model.eval()
  with torch.no_grad():
    before = model(x)
    for module in model.modules():
      if isinstance(module, (CenteredLinear, CenteredConv2d)):
        module.transport(rho=0.0)
    after = model(x)
  return float((after - before).abs().max())


def _check_against_cbp_optax(steps: int = 4) -> float:
  """Max |update difference| of :class:`CBP` and ``cbp.cbp`` in float64.

  Same gradients, two layers of very different gradient scale (so the M1
  clip is active), ``steps`` steps.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import cbp_optax as cbp
  torch.manual_seed(0)
  rng = np.random.default_rng(0)
  layers = [nn.Linear(5, 4).double(), nn.Linear(4, 3).double()]
  opt = CBP([list(layer.parameters()) for layer in layers], lr=1e-2)
  worst = 0.0
  with jax.enable_x64(True):
    params = {f'l{i}': {'kernel': jnp.asarray(l.weight.detach().numpy().T),
                        'bias': jnp.asarray(l.bias.detach().numpy())}
              for i, l in enumerate(layers)}
    tx = cbp.cbp(1e-2)
    state = tx.init(params)
    for _ in range(steps):
      grads = {}
      for i, layer in enumerate(layers):
        gw = rng.standard_normal(tuple(layer.weight.shape)) * 10.0 ** i
        gb = rng.standard_normal(tuple(layer.bias.shape))
        layer.weight.grad, layer.bias.grad = torch.tensor(gw), torch.tensor(gb)
        grads[f'l{i}'] = {'kernel': jnp.asarray(gw.T), 'bias': jnp.asarray(gb)}
      opt.step()
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      for i, layer in enumerate(layers):
        diff = np.abs(np.asarray(params[f'l{i}']['kernel'])
                      - layer.weight.detach().numpy().T).max()
        worst = max(worst, float(diff))
  return worst


if __name__ == '__main__':
  if torch is None:
    raise SystemExit('torch is not installed.')
  print('transport output change (float64):', _check_transport_exact())
  print('max |torch CBP - cbp.cbp| (float64, 4 steps):',
        _check_against_cbp_optax())
  print('parameters: ResNet-8', sum(p.numel() for p in
                                     ResNet8(False).parameters()),
        'MLP-1024', sum(p.numel() for p in MLP(1024, False).parameters()))
