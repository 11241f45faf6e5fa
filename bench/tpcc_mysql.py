#!/usr/bin/env python3
"""Microservices on MariaDB: six databases (crm, orders, inventory, org, billing, catalog, prefixed qagb_) filled
with a small generated TPC-C-like data set, per-user queries joining across them through one read-only
connection, measured block by block. `python bench/tpcc_mysql.py --smoke` is the CI check.

Usage: python bench/tpcc_mysql.py [blocks...] [--targets peer,qag,floor] [--warehouses 2] [--smoke] (see --help)."""
import json
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import blocks as B  # noqa: E402
import harness as H  # noqa: E402
import oltp  # noqa: E402
import targets as T  # noqa: E402

PREFIX = 'qagb_'
DBS = ('crm', 'orders', 'inventory', 'org', 'billing', 'catalog')
RO_USER, RO_PASSWORD = 'qagb_ro', 'qagb_ro_pw'
DISTRICTS = 10
CUSTOMERS = 300      # per district (TPC-C has 3,000: small on purpose)
ITEMS = 5000         # (TPC-C has 100,000)
SEED_VERSION = 1     # bump when the generated data changes, to force a refill

SCHEMA = {
    'org': [
        'CREATE TABLE warehouse (w_id INT PRIMARY KEY, w_name VARCHAR(10), w_street VARCHAR(20), w_city VARCHAR(20),'
        ' w_tax DECIMAL(4,4), w_ytd DECIMAL(12,2))',
        'CREATE TABLE district (d_id INT, d_w_id INT, d_name VARCHAR(10), d_tax DECIMAL(4,4), d_ytd DECIMAL(12,2),'
        ' d_next_o_id INT, PRIMARY KEY (d_w_id, d_id))',
    ],
    'crm': [
        'CREATE TABLE customer (c_id INT, c_d_id INT, c_w_id INT, c_first VARCHAR(16), c_middle CHAR(2),'
        ' c_last VARCHAR(16), c_phone CHAR(16), c_since DATETIME, c_credit CHAR(2), c_credit_lim DECIMAL(12,2),'
        ' c_discount DECIMAL(4,4), c_balance DECIMAL(12,2), c_ytd_payment DECIMAL(12,2), c_payment_cnt INT,'
        ' c_data VARCHAR(500), PRIMARY KEY (c_w_id, c_d_id, c_id), KEY idx_customer_last (c_w_id, c_d_id, c_last))',
    ],
    'orders': [
        'CREATE TABLE orders (o_id INT, o_d_id INT, o_w_id INT, o_c_id INT, o_entry_d DATETIME, o_carrier_id INT,'
        ' o_ol_cnt INT, PRIMARY KEY (o_w_id, o_d_id, o_id), KEY idx_orders_customer (o_w_id, o_d_id, o_c_id, o_id))',
        'CREATE TABLE new_order (no_o_id INT, no_d_id INT, no_w_id INT, PRIMARY KEY (no_w_id, no_d_id, no_o_id))',
        'CREATE TABLE order_line (ol_o_id INT, ol_d_id INT, ol_w_id INT, ol_number INT, ol_i_id INT,'
        ' ol_supply_w_id INT, ol_delivery_d DATETIME, ol_quantity INT, ol_amount DECIMAL(6,2),'
        ' PRIMARY KEY (ol_w_id, ol_d_id, ol_o_id, ol_number))',
    ],
    'inventory': [
        'CREATE TABLE stock (s_i_id INT, s_w_id INT, s_quantity INT, s_ytd INT, s_order_cnt INT, s_data VARCHAR(50),'
        ' PRIMARY KEY (s_w_id, s_i_id))',
    ],
    'catalog': [
        'CREATE TABLE item (i_id INT PRIMARY KEY, i_im_id INT, i_name VARCHAR(24), i_price DECIMAL(5,2),'
        ' i_data VARCHAR(50))',
    ],
    'billing': [
        'CREATE TABLE history (h_c_id INT, h_c_d_id INT, h_c_w_id INT, h_d_id INT, h_w_id INT, h_date DATETIME,'
        ' h_amount DECIMAL(6,2), h_data VARCHAR(24), KEY idx_history_customer (h_c_w_id, h_c_d_id, h_c_id))',
    ],
}

LAST = ['BAR', 'OUGHT', 'ABLE', 'PRI', 'PRES', 'ESE', 'ANTI', 'CALLY', 'ATION', 'EING']


def db(name):
    return PREFIX + name


def root():
    import mysql.connector
    return mysql.connector.connect(host='127.0.0.1', port=3306, user='root', password='', autocommit=True)


def ensure_data(warehouses):
    """Create and fill the six databases unless they already hold this data set (a marker row says which)."""
    conn = root()
    cur = conn.cursor()
    marker = f'{SEED_VERSION}:{warehouses}:{CUSTOMERS}:{ITEMS}'
    try:
        cur.execute(f'SELECT v FROM {db("org")}.bench_marker')
        row = cur.fetchone()
        if row and row[0] == marker:
            ensure_user(cur)
            conn.close()
            return
    except Exception:  # noqa: BLE001 - not there yet
        pass
    H.progress(f'generating the TPC-C-like data set: {warehouses} warehouses, {DISTRICTS} districts, '
               f'{CUSTOMERS} customers per district, {ITEMS} items')
    rnd = random.Random(42)
    for name in DBS:
        cur.execute(f'DROP DATABASE IF EXISTS {db(name)}')
        cur.execute(f'CREATE DATABASE {db(name)}')
        for ddl in SCHEMA[name]:
            cur.execute(f'USE {db(name)}')
            cur.execute(ddl)

    def bulk(table, cols, rows):
        sql = f'INSERT INTO {table} ({", ".join(cols)}) VALUES ({", ".join(["%s"] * len(cols))})'
        for i in range(0, len(rows), 2000):
            cur.executemany(sql, rows[i:i + 2000])

    now = '2026-11-01 12:00:00'
    bulk(f'{db("catalog")}.item', ['i_id', 'i_im_id', 'i_name', 'i_price', 'i_data'],
         [(i, rnd.randint(1, 10000), f'item-{i}', round(rnd.uniform(1, 100), 2), 'data') for i in range(1, ITEMS + 1)])
    bulk(f'{db("org")}.warehouse', ['w_id', 'w_name', 'w_street', 'w_city', 'w_tax', 'w_ytd'],
         [(w, f'wh{w}', 'street', 'city', 0.1, 300000) for w in range(1, warehouses + 1)])
    districts, customers, orders, lines, new_orders, stock, history = [], [], [], [], [], [], []
    for w in range(1, warehouses + 1):
        stock += [(i, w, rnd.randint(10, 100), 0, 0, 'data') for i in range(1, ITEMS + 1)]
        for d in range(1, DISTRICTS + 1):
            districts.append((d, w, f'd{d}', 0.05, 30000, CUSTOMERS + 1))
            perm = list(range(1, CUSTOMERS + 1))
            rnd.shuffle(perm)
            for c in range(1, CUSTOMERS + 1):
                customers.append((c, d, w, f'first{c}', 'OE', LAST[c % 10] + LAST[(c // 10) % 10],
                                  f'{rnd.randint(10**15, 10**16 - 1)}', now, 'GC', 50000, 0.1,
                                  round(rnd.uniform(-100, 100), 2), 10, 1, 'customer data'))
                history.append((c, d, w, d, w, now, 10.0, 'hist'))
            # one order per customer, o_id 1..CUSTOMERS in a random customer order (as TPC-C's load does)
            for o in range(1, CUSTOMERS + 1):
                cnt = rnd.randint(5, 15)
                delivered = o < CUSTOMERS * 0.7
                orders.append((o, d, w, perm[o - 1], now, rnd.randint(1, 10) if delivered else None, cnt))
                if not delivered:
                    new_orders.append((o, d, w))
                for n in range(1, cnt + 1):
                    lines.append((o, d, w, n, rnd.randint(1, ITEMS), w, now if delivered else None, 5,
                                  round(rnd.uniform(0.01, 9999.99), 2) if not delivered else 0))
    bulk(f'{db("org")}.district', ['d_id', 'd_w_id', 'd_name', 'd_tax', 'd_ytd', 'd_next_o_id'], districts)
    bulk(f'{db("crm")}.customer', ['c_id', 'c_d_id', 'c_w_id', 'c_first', 'c_middle', 'c_last', 'c_phone', 'c_since',
                                   'c_credit', 'c_credit_lim', 'c_discount', 'c_balance', 'c_ytd_payment',
                                   'c_payment_cnt', 'c_data'], customers)
    bulk(f'{db("billing")}.history', ['h_c_id', 'h_c_d_id', 'h_c_w_id', 'h_d_id', 'h_w_id', 'h_date', 'h_amount',
                                      'h_data'], history)
    bulk(f'{db("orders")}.orders', ['o_id', 'o_d_id', 'o_w_id', 'o_c_id', 'o_entry_d', 'o_carrier_id', 'o_ol_cnt'],
         orders)
    bulk(f'{db("orders")}.new_order', ['no_o_id', 'no_d_id', 'no_w_id'], new_orders)
    bulk(f'{db("orders")}.order_line', ['ol_o_id', 'ol_d_id', 'ol_w_id', 'ol_number', 'ol_i_id', 'ol_supply_w_id',
                                        'ol_delivery_d', 'ol_quantity', 'ol_amount'], lines)
    bulk(f'{db("inventory")}.stock', ['s_i_id', 's_w_id', 's_quantity', 's_ytd', 's_order_cnt', 's_data'], stock)
    cur.execute(f'CREATE TABLE {db("org")}.bench_marker (v VARCHAR(64))')
    cur.execute(f'INSERT INTO {db("org")}.bench_marker VALUES (%s)', (marker,))
    ensure_user(cur)
    H.progress(f'filled: {len(customers)} customers, {len(orders)} orders, {len(lines)} order lines, '
               f'{len(stock)} stock rows')
    conn.close()


def ensure_user(cur):
    """The one read-only user every gateway connects as: SELECT on the six databases, nothing else."""
    for host in ('127.0.0.1', 'localhost'):
        cur.execute(f"CREATE USER IF NOT EXISTS '{RO_USER}'@'{host}' IDENTIFIED BY '{RO_PASSWORD}'")
        for name in DBS:
            cur.execute(f"GRANT SELECT ON {db(name)}.* TO '{RO_USER}'@'{host}'")


def workload(warehouses):
    connection = {'name': 'shop', 'db': 'mysql', 'host': '127.0.0.1', 'port': 3306, 'user': RO_USER,
                  'password': RO_PASSWORD, 'database': db('crm')}
    ids = {'w': {'type': 'int', 'required': True, 'min': 1}, 'd': {'type': 'int', 'required': True, 'min': 1},
           'c': {'type': 'int', 'required': True, 'min': 1}}
    crm, orders, org, inv = db('crm'), db('orders'), db('org'), db('inventory')
    queries = [
        {'name': 'customer', 'connection_name': 'shop', 'publish': True, 'description': "One customer's row (crm)",
         'sql': f'SELECT c_id, c_first, c_middle, c_last, c_phone, c_credit, c_balance FROM {crm}.customer '
                'WHERE c_w_id = :w AND c_d_id = :d AND c_id = :c',
         'parameters': ids},
        {'name': 'order_status', 'connection_name': 'shop', 'publish': True,
         'description': "TPC-C Order-Status: a customer's last order and its lines (crm, orders)",
         'sql': f'SELECT c.c_first, c.c_last, c.c_balance, o.o_id, o.o_entry_d, o.o_carrier_id, ol.ol_i_id, '
                f'ol.ol_supply_w_id, ol.ol_quantity, ol.ol_amount, ol.ol_delivery_d '
                f'FROM {crm}.customer c '
                f'JOIN {orders}.orders o ON o.o_w_id = c.c_w_id AND o.o_d_id = c.c_d_id AND o.o_c_id = c.c_id '
                f'JOIN {orders}.order_line ol '
                f'ON ol.ol_w_id = o.o_w_id AND ol.ol_d_id = o.o_d_id AND ol.ol_o_id = o.o_id '
                f'WHERE c.c_w_id = :w AND c.c_d_id = :d AND c.c_id = :c '
                f'AND o.o_id = (SELECT MAX(o2.o_id) FROM {orders}.orders o2 '
                f'WHERE o2.o_w_id = :w AND o2.o_d_id = :d AND o2.o_c_id = :c) ORDER BY ol.ol_number',
         'parameters': ids},
        {'name': 'stock_level', 'connection_name': 'shop', 'publish': True,
         'description': 'TPC-C Stock-Level: distinct items under a threshold in the last 20 orders '
                        '(org, orders, inventory)',
         'sql': f'SELECT COUNT(DISTINCT s.s_i_id) AS low_stock FROM {org}.district d '
                f'JOIN {orders}.order_line ol ON ol.ol_w_id = d.d_w_id AND ol.ol_d_id = d.d_id '
                f'AND ol.ol_o_id >= d.d_next_o_id - 20 AND ol.ol_o_id < d.d_next_o_id '
                f'JOIN {inv}.stock s ON s.s_w_id = ol.ol_w_id AND s.s_i_id = ol.ol_i_id '
                f'WHERE d.d_w_id = :w AND d.d_id = :d AND s.s_quantity < :threshold',
         'parameters': {'w': ids['w'], 'd': ids['d'], 'threshold': {'type': 'int', 'required': True}}},
    ]
    plain = {'queries': ['customer', 'order_status', 'stock_level'], 'connections': []}
    keys = {
        'plain': plain,
        'governed': {**plain,
                     'allowed_tables': [f'{crm}.customer', f'{orders}.orders', f'{orders}.order_line',
                                        f'{org}.district', f'{inv}.stock'],
                     'mask': [{'column': '*.c_balance', 'action': 'hash'}]},
    }
    wh = f'[1-{min(warehouses, 9)}]'
    who = rf'w={wh}&d=[1-9]&c=[12][0-9][0-9]'  # customers 100-299 of each district
    calls = [
        T.HELLO,
        T.Call('customer_plain', 'customer', 'plain', rf'/q/customer\?{who}'),
        T.Call('customer_governed', 'customer', 'governed', rf'/q/customer\?{who}'),
        T.Call('order_status_plain', 'order_status', 'plain', rf'/q/order_status\?{who}'),
        T.Call('order_status_governed', 'order_status', 'governed', rf'/q/order_status\?{who}'),
        T.Call('stock_level_plain', 'stock_level', 'plain', rf'/q/stock_level\?w={wh}&d=[1-9]&threshold=1[0-9]'),
    ]
    floor_queries = {}
    for q in queries:
        names = re.findall(r':([a-z_]+)', q['sql'])
        floor_queries[q['name']] = [re.sub(r':[a-z_]+', '%s', q['sql']), names]
    floor_env = {'FLOOR_MYSQL': json.dumps({'host': '127.0.0.1', 'port': 3306, 'user': RO_USER,
                                            'password': RO_PASSWORD, 'database': db('crm')}),
                 'FLOOR_QUERIES': json.dumps(floor_queries)}
    for c in calls:
        if c.key == 'plain':
            c.floor = c.path_regex
    return T.Workload(connection, queries, keys, data_db=None, floor_env=floor_env), calls


def mysql_status():
    conn = root()
    cur = conn.cursor()
    cur.execute("SHOW GLOBAL STATUS WHERE Variable_name IN ('Questions', 'Com_select', 'Com_commit', 'Com_rollback')")
    out = {k.lower(): int(v) for k, v in cur.fetchall()}
    conn.close()
    return out


def roundtrip_counter(target):
    """Statements so far on MariaDB (global: includes other users, and this counter's own SHOW) and
    transactions on the target's PostgreSQL store."""
    out = mysql_status()
    if target.store_db():
        out['store_xacts'] = oltp.pg_xacts(target.store_db())
    return out


def main():
    def extra(p):
        p.add_argument('--warehouses', type=int, default=2, help='TPC-C warehouses to generate (default 2)')
    opts = B.parse_args(__doc__.splitlines()[0], os.path.join(H.BENCH_DIR, 'out', 'tpcc', 'results.jsonl'), extra,
                        db_floor='floor_mysql')
    opts.store_suffix = '_tpcc' + opts.store_suffix
    ensure_data(opts.warehouses)
    w, calls = workload(opts.warehouses)
    bench = B.Bench(opts, 'tpcc_mysql', w, calls, db_comms={'mariadbd', 'mysqld'},
                    roundtrip_counter=roundtrip_counter)
    bench.results.common['warehouses'] = opts.warehouses
    sys.exit(bench.run())


if __name__ == '__main__':
    main()
