"""INT8 and INT4 quantization of exports (projections only; state, gates, norms and custom ops stay float) and
long-horizon drift reports against the fp32 export. `edgemem calibrate` is the command line."""

from edgemem.quant.calibrate import BLOCK_SIZES, METHODS, block_size_for, calibrate, default_out
from edgemem.quant.drift import drift_report, plot_report
from edgemem.quant.graph import boundary_violations, projections, quantized_projections
from edgemem.quant.recipe import Recipe, RecipeError, load_recipe, recipes

__all__ = [
    "BLOCK_SIZES",
    "METHODS",
    "Recipe",
    "RecipeError",
    "block_size_for",
    "boundary_violations",
    "calibrate",
    "default_out",
    "drift_report",
    "load_recipe",
    "plot_report",
    "projections",
    "quantized_projections",
    "recipes",
]
