"""How jaxamp is put together: registries keyed by primitive objects, explicit wiring without
import cycles, per-trace and per-context state (docs/architecture.md)."""

import ast
import contextvars
import pathlib
import re
import threading

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jex_core

import jaxamp
from jaxamp._src.autocast import context, higher_order, rules
from jaxamp._src.policies import policy
from jaxamp._src.policies.table import Variant

PACKAGE = pathlib.Path(jaxamp.__file__).parent


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
  """The jaxamp modules ``path`` imports anywhere: at module level, inside functions and in
  ``if TYPE_CHECKING:`` blocks alike (a cycle through any of them is still a cycle)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      found.add(node.module)
      found.update(f"{node.module}.{alias.name}" for alias in node.names)
  return {name for name in found if name.startswith("jaxamp")}


def _import_graph() -> dict[str, set[str]]:
  modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
  return {
    name: {m for m in _imports(path) if m in modules and m != name}
    for name, path in modules.items()
  }


def test_jaxamp_modules_import_each_other_without_cycles():
  graph = _import_graph()
  done, active = set(), []

  def visit(module):
    if module in active:
      cycle = active[active.index(module) :] + [module]
      pytest.fail(f"import cycle: {' -> '.join(cycle)}")
    if module in done:
      return
    active.append(module)
    for imported in sorted(graph[module]):
      visit(imported)
    active.pop()
    done.add(module)

  for module in sorted(graph):
    visit(module)


def test_policy_tables_import_nothing_but_their_data_types():
  graph = _import_graph()
  tables = [f"jaxamp._src.policies.{device}" for device in ("cuda", "cpu", "xpu", "tpu", "shared")]
  for module in tables:
    assert graph[module] <= {
      "jaxamp._src",
      "jaxamp._src.compat",
      "jaxamp._src.policies",
      "jaxamp._src.policies.table",
      "jaxamp._src.policies.shared",
    }, (module, graph[module])


def _package_imports(graph, package: str) -> set[str]:
  inside = [module for module in graph if module.startswith(f"{package}.")]
  return set().union(*(graph[module] for module in inside))


def test_autocast_and_the_scaler_share_no_code():
  graph = _import_graph()
  autocast_uses = _package_imports(graph, "jaxamp._src.autocast")
  scaler_uses = _package_imports(graph, "jaxamp._src.scaler")
  assert not {m for m in autocast_uses if m.startswith("jaxamp._src.scaler")}, autocast_uses
  assert not {m for m in scaler_uses if m.startswith("jaxamp._src.autocast")}, scaler_uses
  assert not {m for m in scaler_uses if m.startswith("jaxamp._src.policies")}, scaler_uses


def test_the_policy_tables_know_nothing_of_the_interpreter_or_the_reports():
  uses = _package_imports(_import_graph(), "jaxamp._src.policies")
  assert not {m for m in uses if m.startswith(("jaxamp._src.autocast", "jaxamp._src.reports"))}, (
    uses
  )


def test_the_interpreter_does_not_import_the_higher_order_rules_it_is_handed():
  assert (
    "jaxamp._src.autocast.higher_order" not in _import_graph()["jaxamp._src.autocast.interpreter"]
  )
  assert higher_order.BODY_RULES  # handed in by autocast through Context.rules


def _is_primitive_key(key) -> bool:
  return isinstance(key, jex_core.Primitive) or (
    isinstance(key, Variant) and isinstance(key.primitive, jex_core.Primitive)
  )


@pytest.mark.parametrize(
  "registry", ["PRIMITIVE_RULES", "IN_OP_RULES", "KEEP_DTYPES", "COMBINER_PARAM", "MATMULS"]
)
def test_rule_registries_are_keyed_by_primitive_objects(registry):
  keys = list(getattr(rules, registry))
  assert keys and all(_is_primitive_key(key) for key in keys), keys


def test_higher_order_rules_are_keyed_by_primitive_objects():
  assert all(_is_primitive_key(key) for key in higher_order.BODY_RULES)


@pytest.mark.parametrize("device_type", policy.device_types())
def test_policy_tables_are_keyed_by_primitive_objects(device_type):
  keys = list(policy.get_table(device_type).primitive_categories)
  assert keys and all(_is_primitive_key(key) for key in keys), device_type


def test_every_category_has_a_cast_rule():
  assert set(rules.CAST_TARGETS) == set(jaxamp.Category)


def test_lowering_a_function_twice_numbers_its_op_calls_alike():
  def loss(x, y):
    return jaxamp.functional.mse_loss(x, y) + jaxamp.functional.mse_loss(y, x)

  x = jnp.ones((4, 3))
  first = jax.jit(loss).lower(x, x).as_text(debug_info=True)
  second = jax.jit(loss).lower(x, x).as_text(debug_info=True)
  numbers = re.findall(r"jaxamp\.op:mse_loss#(\d+)", first)
  assert sorted(set(numbers)) == ["0", "1"]
  assert re.findall(r"jaxamp\.op:\w+#\d+", first) == re.findall(r"jaxamp\.op:\w+#\d+", second)


def test_explain_records_only_in_its_own_context():
  seen = []

  def record(*args):
    seen.append(args)

  with context.recording(record):
    assert context.current_recorder() is record
    assert contextvars.Context().run(context.current_recorder) is None
    other = []
    thread = threading.Thread(target=lambda: other.append(context.current_recorder()))
    thread.start()
    thread.join()
    assert other == [None]
  assert context.current_recorder() is None


def test_explain_decisions_carry_the_category_and_op_as_data():
  def f(x, w):
    return jax.nn.softmax(x @ w)

  x = jnp.ones((2, 3))
  decisions = jaxamp.explain(f, device_type="cuda")(x, x.T).decisions
  dot = next(d for d in decisions if d.primitive == "dot_general")
  assert (dot.category, dot.op) == ("lower", None)
  inside = [d for d in decisions if d.op == "softmax"]
  assert inside and all(d.category == "float32" for d in inside)
