"""Settings: declared once, malformed ones named, the README's reference generated from them."""
import os

import pytest

from qag import config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults():
    cfg = config.load({})
    assert cfg.workers == "auto" and cfg.max_page_size == 1000 and cfg.allow_writes is False
    assert cfg.query_timeout == 30.0 and cfg.bind == "127.0.0.1:8080"


@pytest.mark.parametrize("env,name", [({"QAG_WORKERS": "two"}, "QAG_WORKERS"), ({"QAG_MAX_PAGE_SIZE": "0"},
                                      "QAG_MAX_PAGE_SIZE"), ({"QAG_ALLOW_WRITES": "maybe"}, "QAG_ALLOW_WRITES"),
                                      ({"QAG_BIND": "nowhere"}, "QAG_BIND"), ({"QAG_QUERY_TIMEOUT": "-1"},
                                      "QAG_QUERY_TIMEOUT"), ({"QAG_DATABASE_URL": "mysql://x"}, "QAG_DATABASE_URL"),
                                      ({"QAG_HISTORY_SAMPLE_RATE": "2"}, "QAG_HISTORY_SAMPLE_RATE")])
def test_malformed_setting_named(env, name):
    with pytest.raises(config.SettingError) as ei:
        config.load(env)
    assert name in str(ei.value)


def test_parsed_types():
    cfg = config.load({"QAG_WORKERS": "3", "QAG_ALLOW_WRITES": "yes", "QAG_QUERY_TIMEOUT": "2.5"})
    assert cfg.workers == 3 and cfg.allow_writes is True and cfg.query_timeout == 2.5


def test_every_setting_documented_in_readme():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert config.reference_markdown() in readme, "regenerate the README's reference with `qag config --reference`"


def test_secrets_not_in_repr():
    assert "s3cret" not in repr(config.load({"QAG_ADMIN_KEY": "s3cret"}))


def test_the_run_store_reads_its_settings_from_the_declarations():
    """qag/runstore's settings are config.py's: same variables, same defaults, same parsers."""
    from qag.runstore import StoreSettings
    from qag.runstore._items import SETTING_OF

    assert StoreSettings() == StoreSettings.from_env({})
    for field, name in SETTING_OF.items():
        assert getattr(StoreSettings(), field) == getattr(config.load({}), name)
    env = {"QAG_EVENTS_RETENTION_HOURS": "5", "QAG_HISTORY_RETENTION_DAYS": "6", "QAG_HISTORY_SAMPLE_RATE": "0.25",
           "QAG_USAGE_RETENTION_DAYS": "7", "QAG_RUN_WRITERS": "4", "QAG_RUN_WRITER_ID": "2",
           "QAG_EVENTS_SETTLE_MS": "8"}
    assert StoreSettings.from_env(env) == StoreSettings(5, 6, 0.25, 7, writer_id=2, writers=4, events_settle_ms=8)
    with pytest.raises(config.SettingError) as ei:
        StoreSettings.from_env({"QAG_USAGE_RETENTION_DAYS": "many"})
    assert "QAG_USAGE_RETENTION_DAYS" in str(ei.value)


def test_behind_the_plane_the_callers_address_is_kept_as_public_bind():
    cfg = config.load({})
    assert not hasattr(cfg, "public_bind")
    cfg.behind_plane("unix:/tmp/x.sock")
    assert (cfg.public_bind, cfg.bind) == ("127.0.0.1:8080", "unix:/tmp/x.sock")
    assert set(config.DERIVED) == {"public_bind"}


def test_defaults_of_the_parts_a_setting_configures_are_the_settings_defaults():
    """Where a part has a default of its own for what a setting sets (used when it runs without a Config: the
    tests, the bench), it is the setting's: one default, whichever way the part is started."""
    import inspect

    import shm
    from qag.recorder import Recorder
    from qag.recorder.journal import Journal

    journal = inspect.signature(Journal).parameters
    recorder = inspect.signature(Recorder).parameters
    assert shm.DEFAULT_SIZE == config.default("shm_size")
    assert journal["max_bytes"].default == config.default("journal_max_bytes")
    assert journal["fsync"].default == config.default("journal_fsync")
    assert recorder["spill_after_s"].default * 1000 == config.default("journal_spill_after_ms")


@pytest.mark.parametrize("url", ["foo", "http://x", "redis://:99999", "redis://h:0", "redis://h:port",
                                 "redis://h/abc", "redis://h?db=x", "unix://"])
def test_malformed_redis_url_named_without_its_password(url):
    with pytest.raises(config.SettingError) as ei:
        config.load({"QAG_REDIS_URL": url})
    assert "QAG_REDIS_URL" in str(ei.value)
    with pytest.raises(config.SettingError) as ei:
        config.load({"QAG_REDIS_URL": url.replace("://", "://user:pw-s3cret@", 1)})
    assert "pw-s3cret" not in str(ei.value) and "QAG_REDIS_URL" in str(ei.value)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "rediss://user:pw@h:6380", "unix:///run/redis.sock",
                                 "redis://h?db=2"])
def test_redis_urls_accepted(url):
    assert config.load({"QAG_REDIS_URL": url}).redis_url == url


def test_run_writer_id_is_a_number_or_a_statefulset_pods_ordinal():
    """The Helm chart passes each pod's own name (a StatefulSet's `<name>-<ordinal>`): two pods of one StatefulSet
    never share an id, and a name without an ordinal, or one not below QAG_RUN_WRITERS, stops startup."""
    for given, wid in (("0", 0), ("5", 5), ("rel-qag-0", 0), ("rel-qag-15", 15), ("qag-3", 3)):
        assert config.load({"QAG_RUN_WRITERS": "16", "QAG_RUN_WRITER_ID": given}).run_writer_id == wid
    for bad in ("", "-1", "qag", "qag-", "qag-x7b2k", "qag--3", "1.5"):
        with pytest.raises(config.SettingError) as ei:
            config.load({"QAG_RUN_WRITERS": "16", "QAG_RUN_WRITER_ID": bad})
        assert "QAG_RUN_WRITER_ID" in str(ei.value), bad
    with pytest.raises(config.SettingError) as ei:
        config.load({"QAG_RUN_WRITERS": "16", "QAG_RUN_WRITER_ID": "rel-qag-16"})
    assert "QAG_RUN_WRITER_ID" in str(ei.value)
    for bad in ("3", "0", "32"):   # each writer takes every W-th id: W must divide the id space evenly
        with pytest.raises(config.SettingError) as ei:
            config.load({"QAG_RUN_WRITERS": bad})
        assert "QAG_RUN_WRITERS" in str(ei.value)
