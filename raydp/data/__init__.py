"""Records, verbaliser, splits, canaries and public corpus (RLDP Sec. 2.1).

Synthetic records (``source="synthetic"``) describe no real patient. The splits are disjoint in
patients, the privacy unit (ERRATA E11): ``load_units`` gives each row's ``patient_nbr`` and
``privacy_unit(manifest)`` the unit a dataset directory was split by.
"""

from raydp.data.canaries import PATTERN as CANARY_PATTERN
from raydp.data.canaries import draw_canaries
from raydp.data.csv_source import load_diabetes_csv, load_ids_mapping
from raydp.data.identity import identity_of, manifest_id
from raydp.data.public import public_corpus, public_records
from raydp.data.schema import COLUMNS, MEDICATIONS, SCHEMA_VERSION, IdMaps, default_id_maps
from raydp.data.splits import (
    PRIVACY_UNIT,
    SPLITS,
    UNIT_COLUMN,
    build_dataset,
    describe_dataset,
    load_audit_canaries,
    load_canaries,
    load_manifest,
    load_split,
    load_texts,
    load_units,
    privacy_unit,
    ALL_SPLITS,
    DEFAULT_FRACTIONS,
    VALIDATION,
    has_split,
)
from raydp.data.build import build_from_config, resolve_dataset
from raydp.data.synthetic import generate_records
from raydp.data.verbalise import verbalise, verbalise_records

__all__ = [
    "CANARY_PATTERN",
    "COLUMNS",
    "MEDICATIONS",
    "PRIVACY_UNIT",
    "SCHEMA_VERSION",
    "SPLITS",
    "ALL_SPLITS",
    "DEFAULT_FRACTIONS",
    "VALIDATION",
    "has_split",
    "UNIT_COLUMN",
    "IdMaps",
    "build_dataset",
    "build_from_config",
    "resolve_dataset",
    "default_id_maps",
    "describe_dataset",
    "draw_canaries",
    "generate_records",
    "identity_of",
    "manifest_id",
    "load_audit_canaries",
    "load_canaries",
    "load_diabetes_csv",
    "load_ids_mapping",
    "load_manifest",
    "load_split",
    "load_texts",
    "load_units",
    "privacy_unit",
    "public_corpus",
    "public_records",
    "verbalise",
    "verbalise_records",
]
