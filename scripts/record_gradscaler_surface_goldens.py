"""Records the rest of ``torch.amp.GradScaler("cpu")``'s surface as golden files for jaxamp's tests.

Regenerate (needs the CPU build of torch; the output is deterministic, byte for byte):

    python scripts/record_gradscaler_surface_goldens.py

writes two files under ``tests/goldens/``:

- ``gradscaler_scale_dtypes.json``: what ``scaler.scale(outputs)`` returns (dtype, shape, bits) for
  0-d and n-d float32/float16/bfloat16/float64/int32/bool tensors, at scales that are and are not
  representable in the output dtype, and for lists, tuples and nested lists of them.
- ``gradscaler_surface.json``:
  ``unscale``: ``scaler.unscale_(optimizer)`` of float32 and bfloat16 gradients (Inf/NaN among
  them) at ordinary, non-power-of-two and huge scales (whose inverse is subnormal): the unscaled
  gradients' bits and ``found_inf``;
  ``scripts``: sequences of ``step`` (finite or Inf gradients, then ``update()``),
  ``update(new_scale)``, the ``set_*`` setters and ``load_state_dict``, with ``state_dict()``
  and the getters after each;
  ``clip_recipe``: torch's "Working with unscaled gradients" recipe (``unscale_``,
  ``clip_grad_norm_``, ``step``, ``update``) training a tiny model with SGD + momentum, Inf/NaN
  injected at seeded steps.

Every float array is stored as bit patterns (hex, of the dtype's width): exact, and JSON has no
Inf/NaN. ``run_script``, ``run_unscale_case`` and ``run_clip_recipe`` are also imported by
``tests/scaler/test_loss_scale_surface.py`` for the live comparison.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

import numpy as np

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "goldens"
DTYPES_FILE = OUT / "gradscaler_scale_dtypes.json"
SURFACE_FILE = OUT / "gradscaler_surface.json"

_BITS = {"float64": np.uint64, "float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
_WIDTH = {"float64": 16, "float32": 8, "float16": 4, "bfloat16": 4}

# ------------------------------------------------------------------------------------------------
# Encoding tensors as JSON (torch side) and decoding them (numpy side, also used by the tests).


def encode(t: Any) -> dict[str, Any]:
  """A torch tensor as ``{"dtype", "shape", "data"}``: hex bit patterns for floats, else values."""
  import torch

  dtype = str(t.dtype).removeprefix("torch.")
  shape = list(t.shape)
  flat = t.detach().reshape(-1)
  if dtype in _BITS:
    view = {"float64": torch.int64, "float32": torch.int32}.get(dtype, torch.int16)
    bits = flat.view(view).numpy().view(_BITS[dtype])
    data = [f"0x{int(b):0{_WIDTH[dtype]}x}" for b in bits]
  else:
    data = [int(v) for v in flat.numpy()]  # int32 and bool
  return {"dtype": dtype, "shape": shape, "data": data}


def decode(d: dict[str, Any]) -> np.ndarray:
  """Inverse of ``encode``, as a NumPy array (bfloat16 via ``ml_dtypes``)."""
  import ml_dtypes

  dtype = d["dtype"]
  if dtype in _BITS:
    bits = np.array([int(x, 16) for x in d["data"]], _BITS[dtype])
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return bits.view(np_dtype).reshape(d["shape"])
  return np.array(d["data"], dtype).reshape(d["shape"])


def _tensor(values: Any, dtype: str) -> Any:
  import torch

  return torch.tensor(np.asarray(values, np.float64), dtype=getattr(torch, dtype))


# ------------------------------------------------------------------------------------------------
# scaler.scale(outputs).

# 2**16 is torch's default (not representable in float16); 30001.7 rounds differently when the
# output dtype is float16 and the product is formed in float32 first (what torch does); 0.1 is
# below one.
SCALE_SCALES = [2.0**16, 30001.7, 0.1]
SCALE_DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "bool"]
SCALE_SHAPES = [[], [4], [2, 3]]


def _values(dtype: str, shape: list[int], seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  n = int(np.prod(shape, dtype=np.int64))
  if dtype == "bool":
    return rng.random(n).reshape(shape) < 0.5
  if dtype == "int32":
    return rng.integers(-1000, 1000, n).reshape(shape)
  v = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)
  v[: max(1, n // 3)] = [1.37, 60000.0, 0.25][: max(1, n // 3)]  # overflow in float16 at 2**16
  return v.reshape(shape)


def scale_cases() -> list[dict[str, Any]]:
  """Single tensors: every (scale, dtype, shape)."""
  import torch

  cases = []
  for i, (scale, dtype, shape) in enumerate(
    (s, d, sh) for s in SCALE_SCALES for d in SCALE_DTYPES for sh in SCALE_SHAPES
  ):
    x = torch.tensor(_values(dtype, shape, i)).to(getattr(torch, dtype))
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    cases.append({"init_scale": scale, "input": encode(x), "output": encode(scaler.scale(x))})
  return cases


def _structure(tree: Any) -> Any:
  """A list/tuple tree of tensors as JSON: ``{"list": [...]}``, ``{"tuple": [...]}`` or a tensor."""
  import torch

  if isinstance(tree, torch.Tensor):
    return encode(tree)
  return {type(tree).__name__: [_structure(x) for x in tree]}


def structure_cases() -> list[dict[str, Any]]:
  """Lists, tuples and nested lists of tensors (torch maps over lists and tuples only)."""
  import torch

  def t(dtype: str, shape: list[int], seed: int) -> Any:
    return torch.tensor(_values(dtype, shape, 100 + seed)).to(getattr(torch, dtype))

  inputs = [
    [t("float32", [], 0), t("float16", [], 1)],
    (t("float16", [3], 2), t("bfloat16", [], 3), t("float32", [2], 4)),
    [(t("float16", [], 5), t("bfloat16", [2], 6)), [t("float32", [], 7)]],
  ]
  cases = []
  for x in inputs:
    scaler = torch.amp.GradScaler("cpu")
    cases.append(
      {"init_scale": 2.0**16, "input": _structure(x), "output": _structure(scaler.scale(x))}
    )
  return cases


# ------------------------------------------------------------------------------------------------
# scaler.unscale_(optimizer).

UNSCALE_SCALES = [2.0**16, 30001.7, 0.1, 2.0**127, 3.0e38]


def run_unscale_case(scale: float, dtype: str, poison: str | None, seed: int) -> dict[str, Any]:
  """``unscale_`` of seeded gradients of two parameters of ``dtype``, one entry poisoned."""
  import torch

  rng = np.random.default_rng(seed)
  grads = [rng.standard_normal(s) * 10.0 ** rng.integers(-2, 3, s) * scale / 100 for s in (5, 3)]
  grads = [np.clip(g, -3e38, 3e38) for g in grads]
  if poison is not None:
    grads[1][1] = float(poison)
  params = [torch.zeros(len(g), dtype=getattr(torch, dtype), requires_grad=True) for g in grads]
  for p, g in zip(params, grads, strict=True):
    p.grad = _tensor(g, dtype)
  scaled = [encode(p.grad.clone()) for p in params]
  scaler = torch.amp.GradScaler("cpu", init_scale=scale)
  scaler.scale(torch.ones(()))
  opt = torch.optim.SGD(params, lr=0.1)
  scaler.unscale_(opt)
  found_inf = sum(
    float(v.item()) for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
  )
  return {
    "init_scale": scale,
    "scale_hex": encode(scaler._scale)["data"][0],
    "scaled": scaled,
    "unscaled": [encode(p.grad) for p in params],
    "found_inf": found_inf > 0,
  }


def unscale_cases() -> list[dict[str, Any]]:
  cases = []
  for i, (scale, dtype, poison) in enumerate(
    (s, d, p) for s in UNSCALE_SCALES for d in ("float32", "bfloat16") for p in (None, "inf", "nan")
  ):
    cases.append(run_unscale_case(scale, dtype, poison, i))
  return cases


# ------------------------------------------------------------------------------------------------
# Scripts: sequences of operations on one scaler, with its state after each.
#
# Operations: ["step", "finite" | "inf"]  gradients of one float32 parameter, step(), update();
#             ["step_new_scale", ["finite" | "inf", float]]  step(), then update(new_scale);
#             ["update_new_scale", float] / ["update_new_scale_tensor", float]  (0-d float32);
#             ["set_growth_factor" | "set_backoff_factor" | "set_growth_interval", value];
#             ["load_state_dict", dict].

SCRIPTS = {
  "update_new_scale_keeps_the_growth_tracker": dict(
    init=dict(init_scale=8.0, growth_interval=3),
    ops=[
      ["step", "finite"],
      ["step", "finite"],
      ["update_new_scale", 3.5],
      ["step", "finite"],
      ["step", "finite"],
      ["step", "finite"],
    ],
  ),
  "update_new_scale_rounds_to_float32": dict(
    init=dict(init_scale=8.0, growth_interval=2, backoff_factor=0.3),
    ops=[
      ["update_new_scale", 0.1],
      ["step", "inf"],
      ["update_new_scale", 3.4028234e38],
      ["step", "finite"],
      ["step", "finite"],
      ["update_new_scale", 1e-45],
      ["step", "inf"],
    ],
  ),
  "update_new_scale_with_a_0d_float32_tensor": dict(
    init=dict(init_scale=8.0, growth_interval=2, growth_factor=1.1),
    ops=[
      ["step", "finite"],
      ["update_new_scale_tensor", 1234.5678],
      ["step", "finite"],
      ["step", "finite"],
    ],
  ),
  "step_then_update_new_scale_replaces_the_automatic_update": dict(
    init=dict(init_scale=8.0, growth_interval=3),
    ops=[
      ["step", "finite"],
      ["step_new_scale", ["finite", 100.0]],
      ["step", "finite"],
      ["step_new_scale", ["inf", 50.0]],
      ["step", "finite"],
      ["step", "finite"],
      ["step", "inf"],
    ],
  ),
  "setters_take_effect_at_the_next_update": dict(
    init=dict(init_scale=1024.0, growth_interval=4),
    ops=[
      ["step", "finite"],
      ["set_growth_interval", 2],
      ["step", "finite"],
      ["set_growth_factor", 1.1],
      ["step", "finite"],
      ["step", "finite"],
      ["set_backoff_factor", 0.3],
      ["step", "inf"],
      ["set_growth_factor", 16.0],
      ["set_growth_interval", 1],
      ["step", "finite"],
    ],
  ),
  "set_growth_interval_below_the_tracker_never_grows_until_an_overflow": dict(
    init=dict(init_scale=64.0, growth_interval=5),
    ops=[
      ["step", "finite"],
      ["step", "finite"],
      ["step", "finite"],
      ["set_growth_interval", 2],
      ["step", "finite"],
      ["step", "finite"],
      ["step", "inf"],
      ["step", "finite"],
      ["step", "finite"],
    ],
  ),
  "load_state_dict_restores_scale_tracker_and_hyperparameters": dict(
    init=dict(init_scale=2.0**16),
    ops=[
      ["step", "finite"],
      [
        "load_state_dict",
        {
          "scale": 100.0,
          "growth_factor": 1.1,
          "backoff_factor": 0.3,
          "growth_interval": 2,
          "_growth_tracker": 1,
        },
      ],
      ["step", "finite"],
      ["step", "inf"],
      ["step", "finite"],
      ["step", "finite"],
    ],
  ),
  "load_state_dict_rounds_the_scale_and_ignores_extra_keys": dict(
    init=dict(init_scale=2.0**16, growth_interval=3),
    ops=[
      ["step", "finite"],
      [
        "load_state_dict",
        {
          "scale": 0.1,
          "growth_factor": 3.0,
          "backoff_factor": 0.25,
          "growth_interval": 3,
          "_growth_tracker": 2,
          "extra": 7,
        },
      ],
      ["step", "finite"],
      ["step", "inf"],
    ],
  ),
}


def _scaler_state(scaler: Any) -> dict[str, Any]:
  return {
    "state_dict": scaler.state_dict(),
    "scale_hex": encode(scaler._scale)["data"][0],
    "get_scale": scaler.get_scale(),
    "get_growth_factor": scaler.get_growth_factor(),
    "get_backoff_factor": scaler.get_backoff_factor(),
    "get_growth_interval": scaler.get_growth_interval(),
    "is_enabled": scaler.is_enabled(),
  }


def run_script(name: str) -> dict[str, Any]:
  """Runs ``SCRIPTS[name]`` on a real ``GradScaler("cpu")``: its state after every operation."""
  import torch

  spec = SCRIPTS[name]
  scaler = torch.amp.GradScaler("cpu", **spec["init"])
  param = torch.zeros(2, requires_grad=True)
  opt = torch.optim.SGD([param], lr=0.1)
  scaler.scale(torch.ones(()))  # initialises the scale tensor, as a training loop does
  after = []
  for op, arg in spec["ops"]:
    if op in ("step", "step_new_scale"):
      kind, new_scale = (arg, None) if op == "step" else arg
      scaler.scale(torch.ones(()))
      param.grad = torch.tensor([1.0, np.inf if kind == "inf" else 2.0])
      scaler.step(opt)
      scaler.update(None if new_scale is None else float(new_scale))
    elif op == "update_new_scale":
      scaler.update(float(arg))
    elif op == "update_new_scale_tensor":
      scaler.update(torch.tensor(arg, dtype=torch.float32))
    elif op == "load_state_dict":
      scaler.load_state_dict(dict(arg))
    else:
      getattr(scaler, op)(arg)
    after.append(_scaler_state(scaler))
  return {"name": name, "init": spec["init"], "ops": spec["ops"], "after": after}


# ------------------------------------------------------------------------------------------------
# The clipping recipe: unscale_, clip_grad_norm_, step, update.

CLIP_CONFIG = dict(
  init_scale=2.0**16,
  growth_factor=2.0,
  backoff_factor=0.5,
  growth_interval=3,
  max_norm=25.0,
  lr=0.01,
  momentum=0.9,
  steps=24,
  seed=3,
  p_inject=0.25,
)


def clip_batch(seed: int, step: int) -> tuple[np.ndarray, np.ndarray]:
  """The data of one step: ``x (4, 3)`` and targets ``y (4, 2)`` (large, so the clip binds)."""
  rng = np.random.default_rng([seed, step])
  x = (rng.standard_normal((4, 3)) * 3).astype(np.float32)
  y = (rng.standard_normal((4, 2)) * 3).astype(np.float32)
  return x, y


def clip_initial_params(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
    "W": rng.standard_normal((2, 3)).astype(np.float32),
    "b": rng.standard_normal(2).astype(np.float32),
  }


def clip_injections(cfg: dict[str, Any]) -> list[Any]:
  """Per step: ``None`` or ``(param name, flat index, "inf" | "-inf" | "nan")``."""
  rng = np.random.default_rng([cfg["seed"], 7])
  out: list[Any] = []
  for _ in range(cfg["steps"]):
    if rng.random() < cfg["p_inject"]:
      name = str(rng.choice(["W", "b"]))
      out.append(
        (
          name,
          int(rng.integers(0, 6 if name == "W" else 2)),
          str(rng.choice(["inf", "-inf", "nan"])),
        )
      )
    else:
      out.append(None)
  return out


def run_clip_recipe(cfg: dict[str, Any] = CLIP_CONFIG) -> dict[str, Any]:
  """torch's recipe for clipping unscaled gradients, step by step."""
  import torch

  init = clip_initial_params(cfg["seed"])
  params = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
  opt = torch.optim.SGD(list(params.values()), lr=cfg["lr"], momentum=cfg["momentum"])
  scaler = torch.amp.GradScaler(
    "cpu",
    init_scale=cfg["init_scale"],
    growth_factor=cfg["growth_factor"],
    backoff_factor=cfg["backoff_factor"],
    growth_interval=cfg["growth_interval"],
  )
  steps = []
  for step, inject in enumerate(clip_injections(cfg)):
    x, y = (torch.from_numpy(a) for a in clip_batch(cfg["seed"], step))
    opt.zero_grad()
    loss = ((x @ params["W"].T + params["b"] - y) ** 2).mean()
    scaler.scale(loss).backward()
    if inject is not None:
      name, index, value = inject
      with torch.no_grad():
        params[name].grad.view(-1)[index] = float(value)
    scaled = {k: encode(p.grad.clone()) for k, p in params.items()}
    scaler.unscale_(opt)
    unscaled = {k: encode(p.grad.clone()) for k, p in params.items()}
    total_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), cfg["max_norm"])
    clipped = {k: encode(p.grad.clone()) for k, p in params.items()}
    found_inf = sum(
      float(v.item())
      for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
    )
    scaler.step(opt)
    scaler.update()
    steps.append(
      {
        "scaled": scaled,
        "unscaled": unscaled,
        "total_norm": encode(total_norm.detach())["data"][0],
        "clipped": clipped,
        "found_inf": found_inf > 0,
        "scale_hex": encode(scaler._scale)["data"][0],
        "growth_tracker": int(scaler._growth_tracker.item()),
        "params": {k: encode(p.detach()) for k, p in params.items()},
      }
    )
  return {
    "config": cfg,
    "init_params": {k: encode(torch.from_numpy(v)) for k, v in init.items()},
    "injections": clip_injections(cfg),
    "steps": steps,
    "state_dict": scaler.state_dict(),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=OUT)
  args = parser.parse_args()
  import torch

  dtypes = {
    "torch_version": torch.__version__,
    "single": scale_cases(),
    "structures": structure_cases(),
  }
  surface = {
    "torch_version": torch.__version__,
    "unscale": unscale_cases(),
    "scripts": [run_script(name) for name in SCRIPTS],
    "clip_recipe": run_clip_recipe(),
  }
  args.out.mkdir(parents=True, exist_ok=True)
  for name, data in ((DTYPES_FILE.name, dtypes), (SURFACE_FILE.name, surface)):
    text = json.dumps(data, indent=None, separators=(",", ":"), allow_nan=False)
    (args.out / name).write_text(text + "\n")
    print(f"wrote {len(text)} bytes to {args.out / name}")


if __name__ == "__main__":
  main()
