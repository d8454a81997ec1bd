-- A session's display name, as the tinker SDK's ServiceClient(display_name=...) sends it with
-- create_session; get_session gives it back. Not unique; NULL when the client gave none.
ALTER TABLE sessions ADD COLUMN display_name text;
