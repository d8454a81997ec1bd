-- Credit grants sent to Stripe as Billing credit grants, which Stripe applies to metered usage
-- before charging the card (billing.credits.send_to_stripe). Kept apart from the append-only grants.
CREATE TABLE credit_grant_stripe (
    grant_id               bigint PRIMARY KEY REFERENCES credit_grants (id),
    stripe_credit_grant_id text NOT NULL UNIQUE,
    sent_at                timestamptz NOT NULL DEFAULT now()
);
