"""qag: a governed SQL-to-REST gateway. Saved SQL queries served as `GET /q/<name>` to scoped API keys."""

__version__ = "0.1.0"
