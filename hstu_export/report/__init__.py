"""The run report: a typed record of one export or inspect run (``record``), built from the pass run and
what export or inspect add (``build``), graph pictures grouped by module (``pictures``), the HTML page
rendered from a jinja2 template (``render``), and the graph dumps written while passes run (``dumps``)."""
