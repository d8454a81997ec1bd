-- A training model's context length, chosen at create_model (issue 64 item 5), and the price
-- book's multipliers for longer contexts.
--
-- training_models.context_length: the longest datum the model takes (api: 400 past it). NULL on
-- models made before this column: their base's max_context_length, as before.
-- price_book.context_tiers: [[above_tokens, percent], ...], ascending; a model whose context is
-- above a tier's tokens pays that tier's percent of every token rate (billing.pricing.context_percent).
-- '[]' (every entry before this, and the default): 100 percent whatever the context.
-- usage_ledger.context_percent: the percent a row was priced at, so that its own columns still
-- reproduce its cost.
ALTER TABLE training_models ADD COLUMN context_length integer CHECK (context_length > 0);
ALTER TABLE price_book ADD COLUMN context_tiers jsonb NOT NULL DEFAULT '[]'::jsonb;
ALTER TABLE usage_ledger ADD COLUMN context_percent integer NOT NULL DEFAULT 100 CHECK (context_percent >= 100);
