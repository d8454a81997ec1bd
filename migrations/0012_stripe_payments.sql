-- Payments through Stripe: the card on file (from a Checkout session in setup mode), a failed
-- invoice payment (the tenant is suspended once it is older than the grace period), and the
-- webhook events already handled (Stripe delivers at least once; a replay changes nothing).
ALTER TABLE billing_accounts ADD COLUMN card_brand text;
ALTER TABLE billing_accounts ADD COLUMN card_last4 text;
ALTER TABLE billing_accounts ADD COLUMN payment_failed_at timestamptz;
ALTER TABLE billing_accounts ADD COLUMN payment_failed_invoice text;

CREATE TABLE stripe_webhook_events (
    event_id    text PRIMARY KEY,
    type        text NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
);
