"""The SQL migrations, installed as `trellis.schema` (setup.py maps this folder into the
package; adapters/postgres/migrations.py reads them with importlib.resources)."""
