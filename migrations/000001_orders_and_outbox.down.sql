DROP TABLE outbox_events;
-- demo:begin
DROP TABLE orders;
-- demo:end
