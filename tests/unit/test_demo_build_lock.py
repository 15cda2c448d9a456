"""Two processes asking for the same cached demo model at once (two runs started together, the suite's workers):
the second waits for the first to finish building (``trainers.demo.building``) instead of failing on the save
path's lock, then finds the model built."""

import subprocess
import sys
import textwrap

from openpack.trainers.demo import building

WAITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from openpack.trainers.demo import building
    cache = Path(sys.argv[1])
    with building(cache):
        print("built already" if (cache / "done").exists() else "building", flush=True)
""")


def test_a_second_builder_waits_for_the_first_and_finds_its_folder(tmp_path):
    cache = tmp_path / "demo_sft-key-seed42"
    with building(cache):
        waiter = subprocess.Popen([sys.executable, "-c", WAITER, str(cache)], stdout=subprocess.PIPE, text=True)
        assert waiter.stdout.readline() == f"openpack: waiting for another process that is building {cache}\n"
        (cache).mkdir()
        (cache / "done").write_text("")  # what the first builder leaves, before it lets go
    out, _ = waiter.communicate(timeout=600)
    assert waiter.returncode == 0 and out == "built already\n"


def test_an_unheld_folder_is_taken_at_once(tmp_path, capsys):
    with building(tmp_path / "x"):
        pass
    with building(tmp_path / "x"):
        pass
    assert capsys.readouterr().out == ""
