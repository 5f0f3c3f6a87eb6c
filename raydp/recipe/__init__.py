"""Recipes: the training settings a run leaves unset, taken from a table searched on PUBLIC data and shipped in the
package (``recipes.json``), per (model, strategy, epsilon). :class:`raydp.config.TrainConfig` fills each recipe field
the user did not set (``recipe: auto``, the default; ``recipe: none`` keeps today's defaults) and records the entry
in ``recipe_applied``. A lookup reads public config values and this package's table only: no dataset, no budget.
"""

from raydp.recipe.table import (  # noqa: F401
    COMPUTE_TIERS, FORMAT_VERSIONS, RECIPE_CHOICES, RECIPE_FIELDS, RECIPES_FILE, TABLE_FORMAT, RecipeEntry, RecipeTable, Resolved,
    TIER_FACTORS, find_entry, load_table, recipe_line, resolve, shipped_table)
