"""Where the tests' files are: the repository root (the working directory of the `chat` children
and the scripts the tests run), tests/, and the fixtures' folders."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")
DATA = os.path.join(TESTS, "data")
GOLDEN = os.path.join(TESTS, "golden")
SUPPORT = os.path.join(TESTS, "support")
