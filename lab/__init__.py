"""The lab: measurement campaigns and the report generators behind docs/reports and the results
table. It is not part of the installed package (pyproject lists train, heads, data, eval and
conf only) and no product module imports it (tests/test_architecture.py); scripts/ runs it from
a checkout.
"""
