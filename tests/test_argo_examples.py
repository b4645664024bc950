"""examples/argo/: the AnalysisTemplate and the Rollout are what Argo Rollouts' own CRD schemas
accept (tests/data/argo/, from the project's published manifests/crds; their headers name the
commit), a broken copy of either is refused, and the template's URL, once Argo has filled in the
Rollout's args, is a request `ddtree-ops gate --serve` answers with the `result` the template's
conditions read.

A CRD's openAPIV3Schema is Kubernetes' structural schema, not quite JSON Schema; `json_schema`
makes it one, keyword by keyword, as the API server reads it:

- an object with `properties` refuses other fields (`additionalProperties: false`) unless it says
  `x-kubernetes-preserve-unknown-fields: true`: the API server's strict field validation (kubectl's
  default) refuses an unknown field, where a plain JSON Schema would let a misspelt `setweight` by;
- `x-kubernetes-int-or-string: true` is an integer or a string (these CRDs spell the anyOf out too);
- `format: int32` / `int64` bound the integer (a JSON Schema format checker);
- `x-kubernetes-list-type: set` has unique items; `map` with `x-kubernetes-list-map-keys` has no two
  items with the same keys (a keyword added to the validator);
- `x-kubernetes-map-type` (how server-side apply merges) has no say in validity: ignored;
- `x-kubernetes-validations` (CEL): the one rule in these schemas is `self == oldSelf` on the
  Rollout's selector, which only an update can break: not evaluated;
- `metadata` is Kubernetes' ObjectMeta, which the CRD leaves open: its name and namespace are
  checked here as DNS-1123 names; `apiVersion` and `kind` must be the CRD's.

The trimmed subtrees (`x-trimmed`, see tests/data/argo/trim_crds.py) carry no keyword: any value
passes there, as the headers say."""

from __future__ import annotations

import copy
import functools
import re
import urllib.parse
from typing import Any, Callable, Iterator

import jsonschema
import pytest
import yaml
from jsonschema import Draft4Validator, FormatChecker, ValidationError
from test_gate_service import Scripted

from ddtree_ops.config.workload_settings import Workload
from ddtree_ops.gates import gate_service as gs
from ddtree_ops.gates.url_gate import GateSettings, bound_s
from kit import REPO

EXAMPLES = REPO / "examples" / "argo"
SCHEMAS = REPO / "tests" / "data" / "argo"
KINDS = {"Rollout": "rollout-schema.yaml", "AnalysisTemplate": "analysis-template-schema.yaml"}
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
OBJECT_META = {"type": "object", "required": ["name"],
               "properties": {"name": {"type": "string", "maxLength": 253, "pattern": DNS1123_SUBDOMAIN},
                              "namespace": {"type": "string", "maxLength": 63, "pattern": DNS1123_LABEL},
                              "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                              "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}


def json_schema(node: Any) -> Any:
    """A structural schema's node as JSON Schema (the module's docstring says what each keyword becomes)."""
    if isinstance(node, list):
        return [json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: ({n: json_schema(s) for n, s in v.items()} if k == "properties" else json_schema(v))
           for k, v in node.items() if k != "default"}  # a default is applied by the server, never checked
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def _list_map_keys(validator: Any, keys: list[str], instance: Any, schema: dict) -> Iterator[ValidationError]:
    if schema.get("x-kubernetes-list-type") != "map" or not isinstance(instance, list):
        return
    seen: set[tuple] = set()
    for item in instance:
        if isinstance(item, dict):
            key = tuple(repr(item.get(k)) for k in keys)
            if key in seen:
                yield ValidationError(f"two items with the same {', '.join(keys)}: "
                                      f"{ {k: item.get(k) for k in keys} }")
            seen.add(key)


FORMATS = FormatChecker()
FORMATS.checks("int32")(lambda v: not isinstance(v, int) or -(2 ** 31) <= v < 2 ** 31)
FORMATS.checks("int64")(lambda v: not isinstance(v, int) or -(2 ** 63) <= v < 2 ** 63)
# Draft 4: OpenAPI 3.0's schema objects are its keywords (exclusiveMaximum a boolean, and so on).
KubeValidator = jsonschema.validators.extend(Draft4Validator, {"x-kubernetes-list-map-keys": _list_map_keys})


@functools.lru_cache(maxsize=None)
def validator_for(kind: str) -> Any:
    doc = yaml.safe_load((SCHEMAS / KINDS[kind]).read_text())
    schema = json_schema(doc["openAPIV3Schema"])
    schema["properties"].update({"apiVersion": {"enum": [f"{doc['group']}/{doc['version']}"]},
                                 "kind": {"enum": [doc["kind"]]}, "metadata": OBJECT_META})
    schema["required"] = sorted({"apiVersion", "kind", "metadata", *schema.get("required", [])})
    KubeValidator.check_schema(schema)
    return KubeValidator(schema, format_checker=FORMATS)


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def errors_of(doc: dict[str, Any], kind: str) -> list[str]:
    """Each error of `doc` as a `kind`, as "path.to.field: message"."""
    return sorted(f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
                  for e in validator_for(kind).iter_errors(doc))


KIND_OF = {"rollout.yaml": "Rollout", "analysis-template.yaml": "AnalysisTemplate"}


def test_the_schemas_name_their_source_commit_and_what_was_cut():
    for name in KINDS.values():
        head = (SCHEMAS / name).read_text().splitlines()[:4]
        assert re.search(r"github.com/argoproj/argo-rollouts commit$", head[0]), head
        assert re.match(r"# [0-9a-f]{40} \(", head[1]) and "manifests/crds/" in head[1], head
        assert "x-trimmed" in "\n".join(head)


@pytest.mark.parametrize("name", ["analysis-template.yaml", "rollout.yaml"])
def test_the_example_is_what_argo_rollouts_crd_schema_accepts(name):
    assert errors_of(example(name), KIND_OF[name]) == []


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def change(doc: dict) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node = doc
        for p in parents:
            node = node[p]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return change


_DELETE = object()
STEPS = "spec.strategy.canary.steps"
WEB = "spec.metrics.0.provider.web"
BROKEN = [
    ("rollout.yaml", _set(f"{STEPS}.0.setWeight", "fifty"), f"{STEPS}.0.setWeight: 'fifty' is not of type 'integer'"),
    ("rollout.yaml", _set(f"{STEPS}.0.setWeight", 2 ** 40), f"{STEPS}.0.setWeight: 1099511627776 is not a 'int32'"),
    ("rollout.yaml", _set(f"{STEPS}.0", {"setweight": 50}), f"{STEPS}.0: Additional properties are not allowed "
                                                            f"('setweight' was unexpected)"),
    ("rollout.yaml", _set(f"{STEPS}.1.analysis.templates.0", {"name": "ddtree-perf-gate"}),
     f"{STEPS}.1.analysis.templates.0: Additional properties are not allowed ('name' was unexpected)"),
    ("rollout.yaml", _set(f"{STEPS}.1.analysis.args.0", {"value": "http://x"}),
     f"{STEPS}.1.analysis.args.0: 'name' is a required property"),
    ("rollout.yaml", _set(f"{STEPS}.2.pause.duration", ["10m"]), f"{STEPS}.2.pause.duration: ['10m'] is not valid "
                                                                  f"under any of the given schemas"),
    ("rollout.yaml", _set("spec.strategy.canary.steps", {"setWeight": 50}),
     "spec.strategy.canary.steps: {'setWeight': 50} is not of type 'array'"),
    ("rollout.yaml", _set("spec.template.spec.containers.0.ports.0.containerPort", "http"),
     "spec.template.spec.containers.0.ports.0.containerPort: 'http' is not of type 'integer'"),
    ("rollout.yaml", lambda d: d["spec"]["template"]["spec"]["containers"].append(
        copy.deepcopy(d["spec"]["template"]["spec"]["containers"][0])),
     "spec.template.spec.containers: two items with the same name: {'name': 'sglang'}"),
    ("rollout.yaml", _set("spec.templat", {}), "spec: Additional properties are not allowed ('templat' was "
                                               "unexpected)"),
    ("rollout.yaml", _set("metadata.name", "SGLang_Kimi"), "metadata.name: 'SGLang_Kimi' does not match"),
    ("rollout.yaml", _set("apiVersion", "argoproj.io/v1"), "apiVersion: 'argoproj.io/v1' is not one of"),
    ("analysis-template.yaml", _set(f"{WEB}.url", _DELETE), f"{WEB}: 'url' is a required property"),
    ("analysis-template.yaml", _set(f"{WEB}.timeoutSeconds", "120"), f"{WEB}.timeoutSeconds: '120' is not of type "
                                                                      f"'integer'"),
    ("analysis-template.yaml", _set("spec.metrics.0.successCondtion", 'result == "pass"'),
     "spec.metrics.0: Additional properties are not allowed ('successCondtion' was unexpected)"),
    ("analysis-template.yaml", _set("spec.metrics.0.provider", {"webhook": {"url": "http://x"}}),
     "spec.metrics.0.provider: Additional properties are not allowed ('webhook' was unexpected)"),
    ("analysis-template.yaml", _set("spec.metrics.0.name", _DELETE), "spec.metrics.0: 'name' is a required property"),
    ("analysis-template.yaml", _set("kind", "ClusterAnalysisTemplate"), "kind: 'ClusterAnalysisTemplate' is not one"),
]


@pytest.mark.parametrize("name, change, error", BROKEN, ids=[e.split(":")[0] + "-" + str(i)
                                                           for i, (_, _, e) in enumerate(BROKEN)])
def test_a_broken_manifest_is_refused_naming_the_field(name, change, error):
    doc = example(name)
    change(doc)
    found = errors_of(doc, KIND_OF[name])
    assert any(e.startswith(error) for e in found), found


def _web_metric() -> dict[str, Any]:
    (metric,) = example("analysis-template.yaml")["spec"]["metrics"]
    return metric


def test_the_template_judges_by_the_services_result_and_an_inconclusive_one_pauses():
    m = _web_metric()
    assert m["successCondition"] == 'result == "pass"' and m["failureCondition"] == 'result == "fail"'
    assert m["provider"]["web"]["jsonPath"] == "{$.result}"
    assert {r.value for r in gs.RESULT_OF.values()} == {"pass", "fail", "inconclusive"}  # the third meets neither
    # Argo's web request must outlast the service's own bound on a measurement.
    assert m["provider"]["web"]["timeoutSeconds"] > bound_s(Workload())
    assert f"bound_s: {bound_s(Workload()):g}" in (EXAMPLES / "analysis-template.yaml").read_text()


def test_the_rollouts_analysis_step_fills_the_templates_args_and_the_service_answers_it():
    template, rollout = example("analysis-template.yaml"), example("rollout.yaml")
    steps = rollout["spec"]["strategy"]["canary"]["steps"]
    assert [next(iter(s)) for s in steps] == ["setWeight", "analysis", "pause", "setWeight"]
    analysis = steps[1]["analysis"]
    assert [t["templateName"] for t in analysis["templates"]] == [template["metadata"]["name"]]
    args = {a["name"]: a["value"] for a in analysis["args"]}
    assert set(args) == {a["name"] for a in template["spec"]["args"]}
    url = _web_metric()["provider"]["web"]["url"]
    filled = re.sub(r"\{\{\s*args\.([a-z-]+)\s*\}\}", lambda m: args[m.group(1)], url)
    u = urllib.parse.urlsplit(filled)
    service = gs.GateService(GateSettings(), gs.AllowList.of((), ["*.llm.svc.cluster.local:30000"]),
                             run=Scripted(), log=lambda msg: None)
    reply = service.handle("GET", f"{u.path}?{u.query}")
    assert reply.status == 200 and reply.doc["result"] == "pass", reply.doc
    assert [(s["role"], s["url"]) for s in reply.doc["servers"]] == [("baseline", args["baseline-url"]),
                                                                     ("canary", args["canary-url"])]
    # The Services the args name are the Rollout's stable and canary Services.
    canary = rollout["spec"]["strategy"]["canary"]
    assert urllib.parse.urlsplit(args["baseline-url"]).hostname.split(".")[0] == canary["stableService"]
    assert urllib.parse.urlsplit(args["canary-url"]).hostname.split(".")[0] == canary["canaryService"]


def test_the_rollouts_selector_selects_its_own_pods():
    spec = example("rollout.yaml")["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
