"""The environment's tool server: `python`, evaluating an arithmetic expression (digits and + - * only)."""
import re

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None

    @vf.tool
    def python(self, code: str) -> str:
        """Run Python code and return what it prints or evaluates to."""
        if not re.fullmatch(r"[\d\s+*\-()]+", code or ""):
            return "error: only arithmetic with + - * is supported"
        return str(eval(code))  # noqa: S307 - the regex admits digits, spaces, + - * and parentheses only


if __name__ == "__main__":
    CalcToolset.run()
