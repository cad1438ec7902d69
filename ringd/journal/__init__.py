"""The run journal: SQLite and PostgreSQL behind one interface, their schemas and transitions."""
