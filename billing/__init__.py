"""Metering and billing: every token priced, nothing billed twice, spend visible.

    pricing       pure: units x price -> micro-USD (the rounding rule), estimates, money text
    price_book    per-base-model rates with effective dates
    ledger        record_usage: one append-only row per completed request (+ daily/hourly rollups)
    budgets       monthly limits per tenant and per API key, checked at admission (402)
    usage         spend by day, model and unit
    stripe_api    the Stripe calls, through the official SDK
    customers     a Stripe customer per billed tenant
    stripe_sync   hourly meter-event roll-up (an outbox) and reconciliation
    tasks         Celery tasks; cli: `quilt usage|budgets|prices|billing`
    fake_stripe   a small stateful Stripe fake for tests and local runs

Import the submodules you need; this package imports nothing, so the trainer does not pay for
Stripe's SDK.
"""
