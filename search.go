package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/meilisearch/meilisearch-go"
)

// searchAdapter is phase 11. Search is an optional dependency: when it is down
// the boot goes on and the features that use it fall back (orders search uses
// SQL). Its readiness check is shown but never fails readiness.
func (a *app) searchAdapter(ctx context.Context, p *phaseRun) error {
	if a.cfg.Search.URL == "" {
		a.health.RegisterSkipped("search", "MEILI_URL is not set")
		return skipPhase("MEILI_URL is not set")
	}
	client := meilisearch.New(a.cfg.Search.URL, meilisearch.WithAPIKey(a.cfg.Search.APIKey))
	a.search = client
	a.lc.RegisterShutdownHook("search", func(context.Context) error { client.Close(); return nil })
	// Meilisearch's errors repeat the request URL with its query and user:
	// scrubbed here, they reach neither the phase note (/admin/lifecycle) nor
	// the ops readiness body, which the log's redact hook does not cover.
	scrub := redactHook{secrets: connPasswords(a.cfg.Search.URL)}
	healthy := func(ctx context.Context) error { return scrub.err(searchHealthy(ctx, client)) }
	a.health.RegisterReadinessCheck("search", false, func(ctx context.Context) checkResult {
		return timedCheck(ctx, healthy)
	})
	if err := healthy(ctx); err != nil {
		return fmt.Errorf("meilisearch at %s is unavailable, search falls back to SQL: %w", redactConnString(a.cfg.Search.URL), err)
	}
	if err := ensureOrdersIndex(ctx, client); err != nil {
		return fmt.Errorf("preparing the %s index, search falls back to SQL: %w", ordersIndex, err)
	}
	return nil
}

// ordersIndex is the Meilisearch index of orders.
const ordersIndex = "orders"

// ensureOrdersIndex creates the orders index and its settings. Meilisearch
// applies both as asynchronous tasks, and creating an index that exists is a
// task that fails harmlessly, so two instances booting at once need no lock.
func ensureOrdersIndex(ctx context.Context, client meilisearch.ServiceManager) error {
	if _, err := client.CreateIndex(ctx, &meilisearch.IndexConfig{Uid: ordersIndex, PrimaryKey: "id"}); err != nil {
		return err
	}
	_, err := client.Index(ordersIndex).UpdateSearchableAttributes(ctx, &[]string{"customer", "items.sku"})
	return err
}

// searchOrderIDs asks Meilisearch for the (public) ids of the orders matching
// q, best first.
func searchOrderIDs(ctx context.Context, client meilisearch.ServiceManager, q string, limit int64) ([]uuid.UUID, error) {
	resp, err := client.Index(ordersIndex).Search(ctx, q, &meilisearch.SearchRequest{Limit: limit, AttributesToRetrieve: []string{"id"}})
	if err != nil {
		return nil, err
	}
	var hits []struct {
		ID uuid.UUID `json:"id"`
	}
	if err := resp.Hits.DecodeInto(&hits); err != nil {
		return nil, fmt.Errorf("decoding search hits: %w", err)
	}
	ids := make([]uuid.UUID, len(hits))
	for i, h := range hits {
		ids[i] = h.ID
	}
	return ids, nil
}

func searchHealthy(ctx context.Context, client meilisearch.ServiceManager) error {
	h, err := client.Health(ctx)
	if err != nil {
		return err
	}
	if h.Status != "available" {
		return errors.New("meilisearch status " + h.Status)
	}
	return nil
}
