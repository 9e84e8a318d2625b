"""Enough of kustomize to render deploy/kubernetes/ without it: ``resources`` (files and folders with
their own kustomization) and ``patches`` given as inline JSON 6902 operations on a target's kind and
name, which is all berth's overlays use. ``kubectl kustomize`` renders the same (the test compares
the two where kubectl is installed)."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml


def render(folder: Path) -> list[dict]:
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - {"apiVersion", "kind", "resources", "patches"}
    assert not unknown, f"{folder}: this renderer knows resources and JSON 6902 patches, not {sorted(unknown)}"
    objects = []
    for resource in spec.get("resources", []):
        path = (folder / resource).resolve()
        objects += render(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in spec.get("patches", []):
        target = patch["target"]
        matched = [o for o in objects if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert matched, f"{folder}: a patch matches nothing: {target}"
        for i, obj in enumerate(objects):
            if obj in matched:
                objects[i] = apply_json_patch(obj, yaml.safe_load(patch["patch"]))
    return objects


def apply_json_patch(document: dict, operations: list[dict]) -> dict:
    """RFC 6902's add, replace and remove (the operations berth's overlays use)."""
    document = copy.deepcopy(document)
    for op in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node = document
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        elif isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if op["op"] == "add":
                node.insert(index, op["value"])
            else:
                node[index] = op["value"]
        else:
            assert op["op"] == "add" or last in node, f"replace of a missing {op['path']}"
            node[last] = op["value"]
    return document
