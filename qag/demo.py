"""`qag demo`: example SQLite data, a connection, three saved queries and two keys, then `qag serve`.

Everything is set up through the Management API itself (in-process), so the demo exercises the same
code as a real operator's calls.
"""
from __future__ import annotations

import os
import random
import secrets
import sqlite3
import sys
import tempfile

import falcon.testing

from qag import config

CUSTOMERS = [("Ada Lovelace", "ada@example.com", "GB"), ("Grace Hopper", "grace@example.org", "US"),
             ("Alan Turing", "alan@example.net", "GB"), ("Edsger Dijkstra", "edsger@example.nl", "NL"),
             ("Barbara Liskov", "barbara@example.com", "US"), ("Donald Knuth", "don@example.edu", "US"),
             ("Margaret Hamilton", "margaret@example.com", "US"), ("Niklaus Wirth", "niklaus@example.ch", "CH")]
PRODUCTS = [("Keyboard", 49.5), ("Mouse", 19.0), ("Monitor", 229.0), ("Laptop stand", 35.25), ("USB hub", 24.99)]


def make_database(path: str, seed: int = 7) -> None:
    rnd = random.Random(seed)
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL, country TEXT);
        CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, price REAL NOT NULL);
        CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                             product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL,
                             ordered_at TEXT NOT NULL);
    """)
    db.executemany("INSERT INTO customers (name, email, country) VALUES (?, ?, ?)", CUSTOMERS)
    db.executemany("INSERT INTO products (name, price) VALUES (?, ?)", PRODUCTS)
    for i in range(60):
        db.execute("INSERT INTO orders (customer_id, product_id, quantity, ordered_at) VALUES (?, ?, ?, ?)",
                   (rnd.randint(1, len(CUSTOMERS)), rnd.randint(1, len(PRODUCTS)), rnd.randint(1, 5),
                    f"2026-11-{1 + i % 28:02d}T{8 + i % 10:02d}:00:00Z"))
    db.commit()
    db.close()


def setup(cfg) -> dict:
    """Create the example database and everything on the API; returns the keys' secrets."""
    from qag.http.app import create_app
    os.makedirs(cfg.home, exist_ok=True)
    path = os.path.join(cfg.home, "example.db")
    if not os.path.exists(path):
        make_database(path)
    app = create_app(cfg)
    client = falcon.testing.TestClient(app)
    h = {"X-API-Key": cfg.admin_key}

    def post(url, body):
        r = client.simulate_post(url, json=body, headers=h)
        if r.status_code not in (200, 201, 409):
            raise SystemExit(f"qag demo: {url} failed: {r.status_code} {r.text}")
        return r.json

    post("/api/v1/connections", {"name": "example", "db": "sqlite", "database": path})
    post("/api/v1/queries", {"name": "customer", "connection_name": "example",
                             "sql": "SELECT id, name, email, country FROM customers WHERE id = :id",
                             "parameters": {"id": {"type": "int", "required": True, "min": 1}},
                             "description": "One customer by id", "publish": True})
    post("/api/v1/queries", {"name": "customer_orders", "connection_name": "example",
                             "sql": "SELECT o.id, c.name, c.email, p.name AS product, o.quantity, "
                                    "o.quantity * p.price AS total, o.ordered_at FROM orders o "
                                    "JOIN customers c ON c.id = o.customer_id JOIN products p ON p.id = o.product_id "
                                    "WHERE c.id = :customer_id ORDER BY o.id",
                             "parameters": {"customer_id": "int"}, "description": "A customer's orders",
                             "publish": True})
    post("/api/v1/queries", {"name": "top_products", "connection_name": "example",
                             "sql": "SELECT p.name, SUM(o.quantity) AS units FROM orders o JOIN products p "
                                    "ON p.id = o.product_id WHERE o.ordered_at >= :since GROUP BY p.name "
                                    "ORDER BY units DESC",
                             "parameters": {"since": {"type": "str", "default": "2026-11-01",
                                                      "pattern": r"\d{4}-\d{2}-\d{2}"}},
                             "description": "Units sold per product since a date", "publish": True})
    secrets_out = {}
    for name, extra in (("demo", {}),
                        ("demo-masked", {"mask": [{"column": "customers.email", "action": "mask"},
                                                  {"column": "customers.name", "action": "hash"}]})):
        client.simulate_delete(f"/api/v1/api-keys/{name}", headers=h)
        body = post("/api/v1/api-keys", {"name": name, "queries": ["customer", "customer_orders", "top_products"],
                                         "allowed_tables": ["customers", "orders", "products"], **extra})
        secrets_out[name] = body["secret"]
    app.runtime.close()
    app.runtime.store.close()
    return secrets_out


def main(args) -> int:
    env = dict(os.environ)
    if not env.get("QAG_HOME"):
        env["QAG_HOME"] = tempfile.mkdtemp(prefix="qag-demo-")
    if not env.get("QAG_ADMIN_KEY"):
        env["QAG_ADMIN_KEY"] = "admin-" + secrets.token_urlsafe(12)
    if args.bind:
        env["QAG_BIND"] = args.bind
    try:
        cfg = config.load(env)
    except config.SettingError as exc:
        print(f"qag: {exc}", file=sys.stderr)
        return 2
    keys = setup(cfg)
    base = "http://" + cfg.bind
    print(f"""
qag demo: store and example data in {cfg.home}
administrator key: {cfg.admin_key}

Try:
  curl -s '{base}/q/customer?id=1' -H 'X-API-Key: {keys['demo']}'
  curl -s '{base}/q/customer_orders?customer_id=2&format=csv' -H 'X-API-Key: {keys['demo']}'
  curl -s '{base}/q/top_products' -H 'X-API-Key: {keys['demo']}'
  # the same customer through a key that masks emails and hashes names:
  curl -s '{base}/q/customer?id=1' -H 'X-API-Key: {keys['demo-masked']}'
  # a bad parameter, and the contract's error:
  curl -s '{base}/q/customer?id=abc' -H 'X-API-Key: {keys['demo']}'
  curl -s {base}/api/v1/queries -H 'X-API-Key: {cfg.admin_key}'
  curl -s {base}/metrics
  curl -s '{base}/q/customer?id=1&format=xlsx' -H 'X-API-Key: {keys['demo']}' -o customer.xlsx
  curl -s {base}/catalog -H 'X-API-Key: {keys['demo']}'

In a browser:
  {base}/console   the Console: sign in with the administrator key above
  {base}/docs      the API reference (OpenAPI 3.1 at {base}/openapi.json)
""", flush=True)
    if args.no_serve:
        return 0
    os.environ.update({k: env[k] for k in ("QAG_HOME", "QAG_ADMIN_KEY")})
    if args.bind:
        os.environ["QAG_BIND"] = args.bind
    from qag.server import serve
    return serve.run(cfg)
