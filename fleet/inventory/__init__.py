"""Inventory files: sites → racks → feeds → servers, plus deployments (docs/inventory.md).

`load` parses and validates a whole file before anything is written; `plan` compares it with
the database and `apply` writes the plan in one transaction; `export` writes the database back
out in the same format, so export → import changes nothing.
"""

from fleet.inventory.apply import ImportReport, apply_plan, import_inventory, plan
from fleet.inventory.export import dump_yaml, export_inventory
from fleet.inventory.schema import InventoryFile, parse_inventory

__all__ = [
    "ImportReport",
    "InventoryFile",
    "apply_plan",
    "dump_yaml",
    "export_inventory",
    "import_inventory",
    "parse_inventory",
    "plan",
]
