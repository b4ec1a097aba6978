"""A policy is a value: the built-in one printed and compared, others derived with with_rules."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxpr_utils
import pytest
from jax import lax

import jaxamp
from jaxamp._src.autocast import higher_order

F16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
X = jnp.linspace(-2.0, 2.0, 32, dtype=jnp.float32).reshape(4, 8)
W = jnp.full((8, 8), 0.1, jnp.float32)


def _softmax_of_matmul(x, w):
  return jax.nn.softmax(x @ w)


def _out_dtype(fun, policy, *args):
  return jaxamp.autocast(fun, policy=policy)(*args).dtype


def test_policy_is_the_builtin_policy_of_a_device_type_and_its_default_dtype():
  cuda = jaxamp.policy("cuda")
  assert isinstance(cuda, jaxamp.Policy)
  assert (cuda.device_type, cuda.dtype) == ("cuda", F16)
  assert jaxamp.policy("cpu").dtype == jnp.bfloat16
  assert jaxamp.policy("cuda", dtype=jnp.bfloat16).dtype == jnp.bfloat16


def test_autocast_with_the_builtin_policy_runs_as_with_its_device_type():
  builtin = jaxamp.autocast(_softmax_of_matmul, device_type="cuda")(X, W)
  given = jaxamp.autocast(_softmax_of_matmul, policy=jaxamp.policy("cuda"))(X, W)
  assert given.dtype == builtin.dtype and jnp.array_equal(given, builtin)


def test_printing_a_policy_shows_its_rows_as_the_coverage_table_does():
  text = str(jaxamp.policy("cuda"))
  assert "| `softmax` | float32 | op region `softmax` |" in text
  assert "| `mm` | lower | primitive `dot_general` |" in text


@pytest.mark.slow
def test_a_torch_op_rule_changes_how_autocast_runs_that_op():
  policy = jaxamp.policy("cuda").with_rules({"softmax": jaxamp.Category.LOWER})
  assert _out_dtype(_softmax_of_matmul, jaxamp.policy("cuda"), X, W) == F32
  assert _out_dtype(_softmax_of_matmul, policy, X, W) == F16


def test_a_primitive_rule_changes_that_primitive_only():
  policy = jaxamp.policy("cuda").with_rules({lax.exp_p: jaxamp.Category.LOWER})
  assert _out_dtype(lambda x, w: jnp.exp(x @ w), policy, X, W) == F16
  assert _out_dtype(lambda x, w: jnp.log1p(x @ w), policy, X, W) == F32


@pytest.mark.slow
def test_a_library_class_rule_changes_its_op_region():
  model = nn.Sequential([nn.Dense(8), nn.LayerNorm()])
  variables = model.init(jax.random.key(0), X)
  policy = jaxamp.policy("cuda").with_rules({nn.LayerNorm: jnp.float16})
  assert _out_dtype(model.apply, jaxamp.policy("cuda"), variables, X) == F32
  assert _out_dtype(model.apply, policy, variables, X) == F16


def test_a_library_function_rule_changes_its_op_region():
  policy = jaxamp.policy("cuda").with_rules({jax.nn.gelu: jnp.float32})
  gelu = lambda x, w: jax.nn.gelu(x @ w)
  assert _out_dtype(gelu, jaxamp.policy("cuda"), X, W) == F16
  assert _out_dtype(gelu, policy, X, W) == F32


def test_a_function_key_changes_its_own_op_of_a_shared_row_only():
  policy = jaxamp.policy("cuda").with_rules({jnp.tensordot: jaxamp.Category.LOWER})
  dense = lambda x, w: jnp.tensordot(x, w, axes=1)  # penzai's Linear
  assert _out_dtype(dense, jaxamp.policy("cuda"), X, W) == F32  # torch's tensordot promotes
  assert _out_dtype(dense, policy, X, W) == F16
  assert [change.key for change in policy.diff()] == ["op region `tensordot`"]


@jaxamp.register_op("squared_for_a_rule", category="float32")
def _squared(h):
  return h * h


def test_a_function_register_ops_decorator_made_is_a_rule_key():
  policy = jaxamp.policy("cuda").with_rules({_squared: jaxamp.Category.LOWER})
  squared = lambda x, w: _squared(x @ w)
  assert _out_dtype(squared, jaxamp.policy("cuda"), X, W) == F32
  assert _out_dtype(squared, policy, X, W) == F16


def test_a_keras_layer_class_is_a_rule_key_by_its_call():
  keras = pytest.importorskip("keras")  # the thirdparty extra; tests/conftest.py picks JAX
  policy = jaxamp.policy("cuda").with_rules({keras.layers.LayerNormalization: jnp.float16})
  assert policy.diff() == jaxamp.policy("cuda").with_rules({"layer_norm": jnp.float16}).diff()


def test_a_dtype_value_is_float32_or_the_policys_lower_dtype():
  policy = jaxamp.policy("cuda")
  by_dtype = policy.with_rules({"softmax": jnp.float16, "mm": jnp.float32})
  by_category = policy.with_rules({"softmax": jaxamp.Category.LOWER, "mm": jaxamp.Category.FLOAT32})
  assert by_dtype == by_category


def test_with_rules_leaves_the_policy_it_derives_from_unchanged():
  cuda = jaxamp.policy("cuda")
  cuda.with_rules({"softmax": jaxamp.Category.LOWER})
  assert cuda == jaxamp.policy("cuda") and not cuda.diff()
  assert _out_dtype(_softmax_of_matmul, jaxamp.policy("cuda"), X, W) == F32


def test_policies_with_equal_rules_are_equal_and_hash_alike():
  rules = {"softmax": jaxamp.Category.LOWER, lax.exp_p: jnp.float16}
  one, two = jaxamp.policy("cuda").with_rules(rules), jaxamp.policy("cuda").with_rules(rules)
  assert one == two and hash(one) == hash(two)
  assert one != jaxamp.policy("cuda")
  stepwise = jaxamp.policy("cuda").with_rules({lax.exp_p: jnp.float16})
  assert stepwise.with_rules({"softmax": jaxamp.Category.LOWER}) == one


def test_a_rule_restating_the_builtin_category_gives_the_builtin_policy():
  same = jaxamp.policy("cuda").with_rules({"softmax": jnp.float32})
  assert same == jaxamp.policy("cuda") and hash(same) == hash(jaxamp.policy("cuda"))


@pytest.mark.slow
def test_the_rewrite_cache_hits_for_equal_policies_and_misses_for_different_ones():
  jaxamp.clear_caches()
  fun = lambda x, w: jax.jit(_softmax_of_matmul)(x, w)
  rules = {"softmax": jaxamp.Category.LOWER}
  first = jaxamp.autocast(fun, policy=jaxamp.policy("cuda").with_rules(rules))(X, W)
  count = len(higher_order._rewrites)
  again = jaxamp.autocast(fun, policy=jaxamp.policy("cuda").with_rules(rules))(X, W)
  assert len(higher_order._rewrites) == count
  builtin = jaxamp.autocast(fun, policy=jaxamp.policy("cuda"))(X, W)
  assert len(higher_order._rewrites) == count + 1
  assert (first.dtype, again.dtype, builtin.dtype) == (F16, F16, F32)


def test_diff_lists_what_a_policy_changes_of_the_builtin_one():
  policy = jaxamp.policy("cuda").with_rules({"softmax": jaxamp.Category.LOWER, lax.exp_p: "lower"})
  changes = {(c.key, c.before, c.after) for c in policy.diff().changes}
  assert changes == {
    ("op region `softmax`", jaxamp.Category.FLOAT32, jaxamp.Category.LOWER),
    ("primitive `exp`", jaxamp.Category.FLOAT32, jaxamp.Category.LOWER),
  }
  assert "op region `softmax`: float32 -> lower" in str(policy.diff())
  assert not policy.diff(policy)


def test_diff_compares_two_device_types():
  changes = {c.key: (c.before, c.after) for c in jaxamp.policy("cpu").diff(jaxamp.policy("cuda"))}
  assert changes["primitive `exp`"] == (jaxamp.Category.FLOAT32, None)


def test_a_rule_for_an_op_region_the_table_lacks_adds_a_row():
  policy = jaxamp.policy("cuda").with_rules({"relu": jaxamp.Category.LOWER})  # torch_xla's row
  assert "| `relu` | lower | op region `relu` |" in str(policy)
  assert _out_dtype(jax.nn.relu, jaxamp.policy("cuda"), X) == F32
  assert _out_dtype(jax.nn.relu, policy, X) == F16


def test_a_torch_op_another_device_type_lists_changes_the_keys_realising_it():
  policy = jaxamp.policy("cuda").with_rules({"conv_tbc": jnp.float32})  # a CPU-list op
  assert [c.key for c in policy.diff()] == ["primitive `conv_general_dilated`"]


def test_a_policy_rule_wins_over_a_registered_default_and_changes_no_other_caller():
  @jaxamp.register_op("policy_values_scaled", category="float32")
  def scaled(x):
    return x * 2.0

  fun = lambda x, w: scaled(x @ w)
  policy = jaxamp.policy("cuda").with_rules({"policy_values_scaled": jaxamp.Category.NATIVE})
  assert _out_dtype(fun, policy, X, W) == F16
  assert _out_dtype(fun, jaxamp.policy("cuda"), X, W) == F32


# --- errors that teach ---------------------------------------------------------------------------


def test_an_unknown_torch_op_name_lists_the_close_valid_ones():
  with pytest.raises(ValueError, match=r"'sofmax'.*Did you mean 'softmax'"):
    jaxamp.policy("cuda").with_rules({"sofmax": jaxamp.Category.LOWER})


def test_an_op_only_category_for_a_primitive_says_why():
  with pytest.raises(ValueError, match=r"FORBIDDEN cannot apply to 'exp' \(primitive exp\)"):
    jaxamp.policy("cuda").with_rules({"exp": jaxamp.Category.FORBIDDEN})
  with pytest.raises(ValueError, match=r"FORBIDDEN cannot apply to primitive 'tanh'"):
    jaxamp.policy("cuda").with_rules({lax.tanh_p: jaxamp.Category.FORBIDDEN})


def test_a_float32_inside_primitive_computes_in_float32_and_returns_its_inputs_dtype():
  policy = jaxamp.policy("cuda").with_rules({lax.tanh_p: jaxamp.Category.FLOAT32_INSIDE})
  fun = jaxamp.autocast(lambda x, w: jnp.tanh(x @ w), policy=policy)
  x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
  assert jaxpr_utils.dtypes_of(jaxpr_utils.traced(fun, x, w), "tanh") == [((F32,), (F32,))]
  assert fun(x, w).dtype == jnp.float16


def test_a_category_for_a_higher_order_primitive_says_why_at_autocast():
  policy = jaxamp.policy("cuda").with_rules({lax.scan_p: jaxamp.Category.FLOAT32})
  with pytest.raises(ValueError, match=r"primitive scan.*higher-order"):
    jaxamp.autocast(_softmax_of_matmul, policy=policy)


def test_another_low_dtype_than_the_policys_names_the_choices():
  with pytest.raises(
    ValueError, match=r"jnp.float32 \(FLOAT32\) or jnp.float16 \(LOWER\).*overrides"
  ):
    jaxamp.policy("cuda").with_rules({"softmax": jnp.bfloat16})


def test_a_none_rule_names_native_and_the_override_that_turns_autocast_off():
  with pytest.raises(ValueError, match=r"got None\. .*Category\.NATIVE.*overrides=\{place: None\}"):
    jaxamp.policy("cuda").with_rules({"softmax": None})


def test_a_float64_rule_says_autocast_goes_up_to_float32_only():
  with pytest.raises(ValueError, match=r"got jnp\.float64\. autocast runs ops in float32 at most"):
    jaxamp.policy("cuda").with_rules({"softmax": jnp.float64})


def test_two_keys_setting_one_op_to_different_categories_raise():
  rules = {"softmax": jaxamp.Category.LOWER, jax.nn.softmax: jaxamp.Category.FLOAT32}
  with pytest.raises(ValueError, match=r"'softmax'.*function softmax.*op region 'softmax'"):
    jaxamp.policy("cuda").with_rules(rules)


def test_two_keys_setting_one_op_to_the_same_category_agree():
  rules = {"softmax": jaxamp.Category.LOWER, jax.nn.softmax: jaxamp.Category.LOWER}
  policy = jaxamp.policy("cuda").with_rules(rules)
  assert policy == jaxamp.policy("cuda").with_rules({"softmax": jaxamp.Category.LOWER})


def test_an_unrecognised_function_key_says_how_to_register_it():
  with pytest.raises(ValueError, match=r"register_op"):
    jaxamp.policy("cuda").with_rules({_softmax_of_matmul: jnp.float32})


def test_a_key_of_another_type_names_the_valid_kinds():
  with pytest.raises(TypeError, match=r"torch op name .*JAX primitive.*library function"):
    jaxamp.policy("cuda").with_rules({3: jnp.float32})


def test_rules_that_are_not_a_mapping_raise_a_type_error():
  with pytest.raises(TypeError, match="mapping"):
    jaxamp.policy("cuda").with_rules([("softmax", jnp.float32)])


def test_a_policy_and_a_device_type_together_raise_naming_the_choice():
  with pytest.raises(TypeError, match=r"either `policy=` or"):
    jaxamp.autocast(_softmax_of_matmul, device_type="cuda", policy=jaxamp.policy("cuda"))


def test_a_policy_that_is_not_a_policy_raises_naming_jaxamp_policy():
  with pytest.raises(TypeError, match=r"jaxamp.policy\(device_type\)"):
    jaxamp.autocast(_softmax_of_matmul, policy="cuda")
