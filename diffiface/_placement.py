"""Where a jax result lives: moved to jax's family, :mod:`diffiface._families._jax_placement`.

Kept only for the modules that still import it by this name (``_results``, for the type of a
layout); import the family module instead.
"""

from ._families._jax_placement import Layout as Layout
