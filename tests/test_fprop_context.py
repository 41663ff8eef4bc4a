"""fprop_context: nesting, inheritance and restoring."""

from tf_gpipe import fprop_context


def test_default_is_training_without_step():
    ctx = fprop_context.current()
    assert ctx.training and ctx.step is None and ctx.seed_offset == 0 and not ctx.recompute


def test_scopes_nest_inherit_and_restore():
    with fprop_context.scope(step=5, seed_offset=2):
        with fprop_context.eval_mode():
            inner = fprop_context.current()
            assert not inner.training and inner.step == 5 and inner.seed_offset == 2
        with fprop_context.scope(recompute=True, seed_offset=3) as ctx:
            assert ctx.recompute and ctx.seed_offset == 3 and ctx.step == 5
        assert fprop_context.current().seed_offset == 2
    assert fprop_context.current().step is None


def test_scope_restores_after_an_exception():
    try:
        with fprop_context.scope(training=False):
            raise RuntimeError('boom')
    except RuntimeError:
        pass
    assert fprop_context.current().training


def test_reads_of_the_recompute_flag_are_counted_but_not_scopes_own():
    before = fprop_context.recompute_reads()
    with fprop_context.scope(recompute=True):
        with fprop_context.scope(step=3):
            assert fprop_context.recompute_reads() == before  # replace's reads are not counted
            assert fprop_context.current().recompute
    assert fprop_context.recompute_reads() == before + 1
    assert fprop_context.current().training  # another field: not counted
    assert fprop_context.recompute_reads() == before + 1
