"""Documentation stays in step with the code: settings, metrics and endpoints (STYLE 4)."""
import os

from qag import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_metric_documented_in_readme():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert metrics.reference_markdown() in readme, "regenerate the README's metrics table from qag/metrics.py"


def test_every_route_in_openapi(tmp_path):
    from qag import config
    from qag.http.app import create_app
    from qag.http.openapi import DOC_ASSET_ROUTES, static_paths
    app = create_app(config.load({"QAG_HOME": str(tmp_path)}))
    routes = set()

    def walk(nodes):
        for n in nodes:
            if n.resource is not None and n.uri_template:
                routes.add(n.uri_template)
            walk(n.children)
    walk(app.falcon._router._roots)
    from qag.http import console
    # the Console's own pages and files are HTML behind its sign-in, not API operations: /console stands for them
    missing = routes - set(static_paths()) - set(DOC_ASSET_ROUTES) - set(console.ROUTES[1:])
    assert not missing, f"routes missing from /openapi.json: {sorted(missing)}"


def test_every_route_in_api_contract_exists(tmp_path):
    """The contract's routes (docs/api.md) are all served."""
    from qag.http.openapi import static_paths
    STATIC_PATHS = static_paths()
    for path in ("/q/{name}", "/api/v1/connections", "/api/v1/connections/test", "/api/v1/connections/{name}",
                 "/api/v1/queries", "/api/v1/queries/{name}", "/api/v1/queries/{name}/versions",
                 "/api/v1/queries/{name}/publish", "/api/v1/api-keys", "/api/v1/api-keys/{name}",
                 "/api/v1/api-keys/{name}/rotate", "/api/v1/history", "/api/v1/usage", "/events", "/health",
                 "/metrics", "/openapi.json", "/docs", "/", "/catalog", "/connections/{name}/schema"):
        assert path in STATIC_PATHS
