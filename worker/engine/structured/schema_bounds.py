"""What a JSON schema's shape may cost before it compiles (``SchemaBounds``, ``over_bounds``):
properties, optional properties of one object, depth, enum values. docs/engine.md says why."""

from __future__ import annotations

from dataclasses import dataclass

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
            "propertyNames", "unevaluatedItems", "unevaluatedProperties")


@dataclass(frozen=True)
class SchemaBounds:
    """``Settings.structured_max_properties`` and kin."""

    properties: int = 2000
    optional_properties: int = 256
    depth: int = 32
    enum_values: int = 2000

    @classmethod
    def of(cls, settings) -> SchemaBounds:
        return cls(settings.structured_max_properties, settings.structured_max_optional_properties,
                   settings.structured_max_depth, settings.structured_max_enum_values)


@dataclass(frozen=True)
class SchemaShape:
    properties: int  # in the whole schema
    optional: int  # the most optional properties of one object ...
    optional_at: str  # ... and where that object is (a JSON path)
    depth: int  # schemas nested in schemas; the top one is 1
    enum_values: int  # enum values and consts in the whole schema


def shape(schema: dict) -> SchemaShape:
    properties = optional = depth = enum_values = 0
    optional_at = "$"
    stack = [(schema, "$", 1)]
    while stack:
        node, path, level = stack.pop()
        if not isinstance(node, dict):
            continue
        depth = max(depth, level)
        if isinstance(node.get("enum"), list):
            enum_values += len(node["enum"])
        if "const" in node:
            enum_values += 1
        props = node.get("properties")
        if isinstance(props, dict):
            properties += len(props)
            required = node.get("required") if isinstance(node.get("required"), list) else []
            missing = len(set(props) - set(required))
            if missing > optional:
                optional, optional_at = missing, path
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{path}.{key}.{name}", level + 1) for name, sub in node[key].items())
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{path}.{key}[{i}]", level + 1) for i, sub in enumerate(node[key]))
        for key in _SCHEMAS:
            sub = node.get(key)
            if isinstance(sub, list):  # draft 4's items as a list
                stack.extend((s, f"{path}.{key}[{i}]", level + 1) for i, s in enumerate(sub))
            elif isinstance(sub, dict):
                stack.append((sub, f"{path}.{key}", level + 1))
    return SchemaShape(properties, optional, optional_at, depth, enum_values)


def over_bounds(schema: dict, bounds: SchemaBounds) -> str | None:
    """Why ``schema`` is too costly to compile under ``bounds``, or None."""
    s = shape(schema)
    if s.properties > bounds.properties:
        return (f"the schema has {s.properties:,} properties, over the limit of {bounds.properties:,} "
                "(BERTH_STRUCTURED_MAX_PROPERTIES): split the request, or raise the limit")
    if s.optional > bounds.optional_properties:
        return (f"the object at {s.optional_at} has {s.optional:,} optional properties (not in its \"required\"), "
                f"over the limit of {bounds.optional_properties:,} (BERTH_STRUCTURED_MAX_OPTIONAL_PROPERTIES): "
                "compiling grows steeply with them; list them in \"required\" (a type that allows null keeps "
                "them optional in meaning), or raise the limit")
    if s.depth > bounds.depth:
        return (f"the schema nests schemas {s.depth} deep, over the limit of {bounds.depth} "
                "(BERTH_STRUCTURED_MAX_DEPTH): flatten it (use $defs and $ref)")
    if s.enum_values > bounds.enum_values:
        return (f"the schema has {s.enum_values:,} enum and const values, over the limit of {bounds.enum_values:,} "
                "(BERTH_STRUCTURED_MAX_ENUM_VALUES): shorten the lists, or raise the limit")
    return None
