"""Router: x -> logits, top-k experts and weights, and the dropless expert order."""

from aristax.pallas_kernels.route.api import route
from aristax.pallas_kernels.route.reference import RouteOutput
from aristax.pallas_kernels.route.triton import RouteTiles

__all__ = ["RouteOutput", "RouteTiles", "route"]
