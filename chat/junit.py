"""JUnit XML for a replay suite, the report CI systems read (`chat replay ... --junit FILE`).

One <testsuite> inside <testsuites>; one <testcase> per recording (classname: its directory, name:
its file name, time: the replay's seconds). A divergence is a <failure> and an invalid recording an
<error>, each with the report as its text; near ties are listed in the case's <system-out>.
Characters XML 1.0 cannot hold (control characters a model may emit) are written as \\xNN.
"""
from __future__ import annotations

import os
import re
import socket
import time
import xml.etree.ElementTree as ET

from .suite import DIVERGENCE, INVALID, NEAR_TIES, SuiteResult
from .transcript import write_atomic

_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_text(text: str) -> str:
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def junit_xml(suite: SuiteResult, name: str = "chat replay") -> str:
    outcomes = suite.outcomes
    total = sum(o.seconds for o in outcomes) + suite.load_seconds
    counts = dict(tests=str(len(outcomes)), failures=str(sum(o.status == DIVERGENCE for o in outcomes)),
                  errors=str(sum(o.status == INVALID for o in outcomes)), skipped="0", time=f"{total:.3f}")
    root = ET.Element("testsuites", name=name, **counts)
    testsuite = ET.SubElement(root, "testsuite", name=name, **counts, hostname=socket.gethostname(),
                              timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
    for o in outcomes:
        case = ET.SubElement(testsuite, "testcase", classname=os.path.dirname(o.path) or ".",
                             name=os.path.basename(os.path.normpath(o.path)), file=o.path, time=f"{o.seconds:.3f}")
        if o.status in (DIVERGENCE, INVALID):
            tag = "failure" if o.status == DIVERGENCE else "error"
            element = ET.SubElement(case, tag, message=_xml_text(o.result if o.status == DIVERGENCE
                                                                 else o.report.splitlines()[0]), type=o.status)
            element.text = _xml_text(o.report)
        elif o.status == NEAR_TIES:
            ET.SubElement(case, "system-out").text = _xml_text(f"{o.result}:\n{o.report}")
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(path: str, suite: SuiteResult) -> None:
    write_atomic(path, junit_xml(suite))
