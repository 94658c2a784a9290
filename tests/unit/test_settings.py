"""shardtrain.settings: typed settings from flags and an explicit environment mapping."""

from __future__ import annotations

import grp
import os

import pytest

from shardtrain import checksums
from shardtrain.errors import InvalidArgument
from shardtrain.settings import (
    CoordinatorSettings, Security, ShardSettings, Timeouts, checksums_from_env, coordinator_parser,
    coordinator_settings, security_env, security_from_env, shard_parser, shard_settings, timeouts_env,
)
from shardtrain.wire import DEFAULT_CHUNK_BYTES

COORDINATOR = {"SHARDTRAIN_COORDINATOR": "coord:7000"}


def test_shard_defaults_with_only_a_coordinator():
    assert shard_settings([], COORDINATOR) == ShardSettings(
        coordinator="coord:7000", bind="127.0.0.1:0", advertise="", device="cpu",
        chunk_bytes=DEFAULT_CHUNK_BYTES, threads=0, security=Security(role="shard"), timeouts=Timeouts())


def test_shard_reads_every_shardtrain_variable():
    env = {
        "SHARDTRAIN_COORDINATOR": "coord:7000", "SHARDTRAIN_BIND": "0.0.0.0:7001",
        "SHARDTRAIN_ADVERTISE": "shard-a:7001",
        "SHARDTRAIN_DEVICE": "cuda:1", "SHARDTRAIN_CHUNK_BYTES": "4096", "SHARDTRAIN_THREADS": "2",
        "SHARDTRAIN_AUTH_TOKEN": "tok", "SHARDTRAIN_TLS_CERT": "cert.pem", "SHARDTRAIN_TLS_KEY": "key.pem",
        "SHARDTRAIN_TLS_CA": "ca.pem", "SHARDTRAIN_TLS_SERVER_NAME": "shards.local",
    }
    settings = shard_settings([], env)
    assert (settings.coordinator, settings.bind, settings.advertise, settings.device, settings.chunk_bytes,
            settings.threads) == ("coord:7000", "0.0.0.0:7001", "shard-a:7001", "cuda:1", 4096, 2)
    assert settings.security == Security(token="tok", role="shard", tls_cert="cert.pem", tls_key="key.pem",
                                         tls_ca="ca.pem", tls_server_name="shards.local")


def test_shard_flags_override_the_environment():
    env = {"SHARDTRAIN_COORDINATOR": "coord:7000", "SHARDTRAIN_BIND": "0.0.0.0:7001", "SHARDTRAIN_DEVICE": "cuda",
           "SHARDTRAIN_CHUNK_BYTES": "4096", "SHARDTRAIN_THREADS": "2", "SHARDTRAIN_AUTH_TOKEN": "from-env"}
    settings = shard_settings(["--coordinator", "other:1", "--bind", "127.0.0.1:9", "--device", "cpu",
                               "--chunk-bytes", "512", "--threads", "1", "--auth-token", "from-flag"], env)
    assert (settings.coordinator, settings.bind, settings.device, settings.chunk_bytes, settings.threads,
            settings.security.token) == ("other:1", "127.0.0.1:9", "cpu", 512, 1, "from-flag")


def test_shard_flush_denormal_is_off_unless_a_flag_or_variable_turns_it_on():
    assert not shard_settings([], COORDINATOR).flush_denormal
    assert shard_settings(["--flush-denormal", "on"], COORDINATOR).flush_denormal
    env = {**COORDINATOR, "SHARDTRAIN_FLUSH_DENORMAL": "on"}
    assert shard_settings([], env).flush_denormal
    assert not shard_settings(["--flush-denormal", "off"], env).flush_denormal


def test_shard_flush_denormal_takes_on_or_off(capsys):
    with pytest.raises(SystemExit):
        shard_settings(["--flush-denormal", "yes"], COORDINATOR)
    assert "--flush-denormal" in capsys.readouterr().err


def test_shard_coordinator_from_model_host_and_port():
    assert shard_settings([], {"MODEL_HOST": "seed-host", "MODEL_PORT": "5000"}).coordinator == "seed-host:5000"


def test_shard_coordinator_flag_overrides_model_host_and_port():
    env = {"MODEL_HOST": "seed-host", "MODEL_PORT": "5000"}
    assert shard_settings(["--coordinator", "flag:1"], env).coordinator == "flag:1"


def test_shard_coordinator_variable_wins_over_the_model_host_fallback():
    env = {"SHARDTRAIN_COORDINATOR": "coord:7000", "MODEL_HOST": "seed-host", "MODEL_PORT": "5000"}
    assert shard_settings([], env).coordinator == "coord:7000"


@pytest.mark.parametrize("env", [{}, {"MODEL_HOST": "seed-host"}, {"MODEL_PORT": "5000"},
                                 {"SHARDTRAIN_COORDINATOR": ""}])
def test_shard_without_a_coordinator_exits_naming_the_flag(env, capsys):
    with pytest.raises(SystemExit) as exit_info:
        shard_settings([], env)
    assert exit_info.value.code == 2
    assert "--coordinator HOST:PORT" in capsys.readouterr().err


def test_shard_unknown_flag_exits(capsys):
    with pytest.raises(SystemExit):
        shard_settings(["--no-such-flag"], COORDINATOR)
    assert "--no-such-flag" in capsys.readouterr().err


def test_shard_non_numeric_chunk_bytes_flag_exits(capsys):
    with pytest.raises(SystemExit):
        shard_settings(["--chunk-bytes", "lots"], COORDINATOR)
    assert "--chunk-bytes" in capsys.readouterr().err


def test_settings_ignore_variables_without_the_prefix():
    settings = shard_settings([], {**COORDINATOR, "BIND": "0.0.0.0:1", "AUTH_TOKEN": "x", "DEVICE": "cuda"})
    assert (settings.bind, settings.security.token, settings.device) == ("127.0.0.1:0", "", "cpu")


def test_coordinator_defaults():
    assert coordinator_settings([], {}) == CoordinatorSettings(bind="127.0.0.1:0", security=Security(role="shard"))


def test_coordinator_bind_from_env_and_flag():
    env = {"SHARDTRAIN_BIND": "0.0.0.0:7000", "SHARDTRAIN_AUTH_TOKEN": "tok"}
    assert coordinator_settings([], env) == CoordinatorSettings(bind="0.0.0.0:7000",
                                                                security=Security(token="tok", role="shard"))
    assert coordinator_settings(["--bind", "127.0.0.1:5"], env).bind == "127.0.0.1:5"


# The token: inline or from a file.

def test_token_file_is_read_and_stripped(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("  file-token \n")
    assert coordinator_settings(["--auth-token-file", str(token_file)], {}).security.token == "file-token"


def test_token_file_from_env(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    settings = shard_settings([], {**COORDINATOR, "SHARDTRAIN_AUTH_TOKEN_FILE": str(token_file)})
    assert settings.security.token == "file-token"


def test_token_file_flag_wins_over_token_in_env(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("file-token")
    settings = coordinator_settings(["--auth-token-file", str(token_file)], {"SHARDTRAIN_AUTH_TOKEN": "env-token"})
    assert settings.security.token == "file-token"


def test_token_flag_wins_over_token_file_in_env(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("file-token")
    settings = coordinator_settings(["--auth-token", "flag-token"], {"SHARDTRAIN_AUTH_TOKEN_FILE": str(token_file)})
    assert settings.security.token == "flag-token"


# Security

def test_metadata_carries_the_bearer_token():
    assert Security(token="s3cret").metadata == (("authorization", "Bearer s3cret"),)


def test_metadata_is_empty_without_a_token():
    assert Security().metadata == ()


def test_security_from_env_reads_only_shardtrain_variables():
    env = {"SHARDTRAIN_AUTH_TOKEN": "tok", "SHARDTRAIN_TLS_CA": "ca.pem", "TLS_CERT": "ignored.pem"}
    assert security_from_env(env) == Security(token="tok", tls_ca="ca.pem")


def test_security_env_sets_only_what_is_configured():
    assert security_env(Security()) == {}
    assert security_env(Security(token="tok", tls_ca="ca.pem")) == {"SHARDTRAIN_AUTH_TOKEN": "tok",
                                                                      "SHARDTRAIN_TLS_CA": "ca.pem"}


def test_security_env_round_trips_through_security_from_env():
    security = Security(token="tok", tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem", tls_server_name="n")
    assert security_from_env(security_env(security)) == security


def test_shared_memory_can_be_turned_off_by_flag_or_variable():
    assert shard_settings(["--coordinator", "c:1"], env={}).shared_memory
    assert not shard_settings(["--coordinator", "c:1", "--shared-memory", "off"], env={}).shared_memory
    assert not shard_settings(["--coordinator", "c:1"], env={"SHARDTRAIN_SHARED_MEMORY": "off"}).shared_memory


def test_local_links_can_be_turned_off_by_flag_or_variable():
    assert shard_settings(["--coordinator", "c:1"], env={}).local_links
    assert not shard_settings(["--coordinator", "c:1", "--local-links", "off"], env={}).local_links
    assert not shard_settings(["--coordinator", "c:1"], env={"SHARDTRAIN_LOCAL_LINKS": "off"}).local_links


def test_checksums_are_a_kind_from_a_flag_or_variable():
    assert shard_settings(["--coordinator", "c:1"], env={}).checksums == checksums.DEFAULT
    assert shard_settings(["--coordinator", "c:1", "--checksums", "crc32"], env={}).checksums == "crc32"
    assert shard_settings(["--coordinator", "c:1", "--checksums", "off"], env={}).checksums == "off"
    assert shard_settings(["--coordinator", "c:1"], env={"SHARDTRAIN_CHECKSUMS": "on"}).checksums == \
        checksums.STRONGEST == "crc32c"  # the crc32c package is a dependency
    assert checksums_from_env({"SHARDTRAIN_CHECKSUMS": "crc32c"}) == "crc32c"
    assert checksums_from_env({}) == checksums.DEFAULT
    with pytest.raises(InvalidArgument, match="SHARDTRAIN_CHECKSUMS: checksums 'md5'"):
        checksums_from_env({"SHARDTRAIN_CHECKSUMS": "md5"})
    with pytest.raises(SystemExit):
        shard_settings(["--coordinator", "c:1"], env={"SHARDTRAIN_CHECKSUMS": "md5"})


def test_tcp_links_can_be_turned_off_by_flag_or_variable():
    assert shard_settings(["--coordinator", "c:1"], env={}).tcp_links
    assert not shard_settings(["--coordinator", "c:1", "--tcp-links", "off"], env={}).tcp_links
    assert not shard_settings(["--coordinator", "c:1"], env={"SHARDTRAIN_TCP_LINKS": "off"}).tcp_links


def test_unauthenticated_serving_beyond_loopback_is_off_unless_a_flag_or_variable_allows_it():
    assert not coordinator_settings([], {}).security.allow_unauthenticated
    assert coordinator_settings(["--allow-unauthenticated"], {}).security.allow_unauthenticated
    assert coordinator_settings([], {"SHARDTRAIN_ALLOW_UNAUTHENTICATED": "1"}).security.allow_unauthenticated


def test_role_tokens_come_from_files_or_variables_and_services_present_the_shard_token(tmp_path):
    shard_file = tmp_path / "shard-token"
    shard_file.write_text("s-from-file\n")
    env = {**COORDINATOR, "SHARDTRAIN_AUTH_TOKEN": "t", "SHARDTRAIN_READER_TOKEN": "r"}
    security = shard_settings(["--shard-token-file", str(shard_file)], env).security
    assert (security.token, security.shard_token, security.reader_token, security.role) == \
        ("t", "s-from-file", "r", "shard")
    assert coordinator_settings([], {"SHARDTRAIN_SHARD_TOKEN": "s"}).security.role == "shard"
    assert security_from_env({"SHARDTRAIN_AUTH_TOKEN": "t"}).role == "client"


def test_security_env_carries_the_role_tokens_to_child_services():
    security = Security(token="t", shard_token="s", reader_token="r")
    assert security_from_env(security_env(security)) == security


@pytest.mark.parametrize("given, expected", [("0", 0), ("1048576", 2**20), ("512M", 512 * 2**20), ("1.5G", 3 * 2**29),
                                             ("12GiB", 12 * 2**30), ("2t", 2 * 2**40)])
def test_shard_memory_takes_bytes_or_a_size_with_a_unit(given, expected):
    assert shard_settings(["--coordinator", "h:1", "--memory", given], env={}).memory_bytes == expected
    assert shard_settings(["--coordinator", "h:1"], env={"SHARDTRAIN_MEMORY": given}).memory_bytes == expected


def test_shard_memory_that_is_not_a_size_is_refused(capsys):
    with pytest.raises(SystemExit):
        shard_settings(["--coordinator", "h:1", "--memory", "lots"], env={})
    assert "'lots' is not a size; give bytes or a number with K, M, G or T" in capsys.readouterr().err


def test_every_deadline_is_a_flag_and_a_variable_and_a_local_cluster_passes_them_on():
    shard = shard_settings(["--coordinator", "c:1", "--timeout-peer-wait", "7.5"], {"SHARDTRAIN_TIMEOUT_RPC": "30"})
    assert (shard.timeouts.peer_wait, shard.timeouts.rpc, shard.timeouts.control) == (7.5, 30.0, Timeouts().control)
    coordinator = coordinator_settings(["--timeout-probe", "2"], {"SHARDTRAIN_TIMEOUT_EXPIRY": "90"})
    assert (coordinator.timeouts.probe, coordinator.timeouts.expiry) == (2.0, 90.0)
    assert timeouts_env(Timeouts(peer_wait=7.5)) == {"SHARDTRAIN_TIMEOUT_PEER_WAIT": "7.5"}
    assert shard_settings(["--coordinator", "c:1"], timeouts_env(Timeouts(rpc=3, heartbeat=2))).timeouts == \
        Timeouts(rpc=3, heartbeat=2)


@pytest.mark.parametrize("value", ["0", "-1", "soon", "100000"])
def test_a_deadline_that_is_not_a_positive_number_of_seconds_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        shard_settings(["--coordinator", "c:1", "--timeout-rpc", value])
    assert "--timeout-rpc" in capsys.readouterr().err


@pytest.mark.parametrize("parser", [shard_parser, coordinator_parser])
def test_every_flag_says_what_it_does(parser):
    undocumented = [action.option_strings for action in parser({})._actions if not action.help]
    assert not undocumented


def test_shard_checkpoint_group_by_name_or_id_from_a_flag_or_variable(capsys):
    own = grp.getgrgid(os.getegid())
    assert shard_settings([], COORDINATOR).checkpoint_group == -1  # none: the files are the shard's user's alone
    assert shard_settings(["--checkpoint-group", own.gr_name], COORDINATOR).checkpoint_group == own.gr_gid
    assert shard_settings([], {**COORDINATOR, "SHARDTRAIN_CHECKPOINT_GROUP": str(own.gr_gid)}).checkpoint_group \
        == own.gr_gid
    with pytest.raises(SystemExit):
        shard_settings(["--checkpoint-group", "no-such-group-here"], COORDINATOR)
    assert "no group is called 'no-such-group-here'" in capsys.readouterr().err
