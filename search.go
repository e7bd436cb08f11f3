package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/meilisearch/meilisearch-go"
)

// connectSearch is phase 11. Search is an optional dependency: when it is down
// the boot goes on and the features that use it fall back (orders search uses
// SQL). Its readiness check is shown but never fails readiness.
func (a *app) connectSearch(ctx context.Context, p *phaseRun) error {
	if a.cfg.Search.URL == "" {
		a.health.RegisterSkipped("search", "MEILI_URL is not set")
		return skipPhase("MEILI_URL is not set")
	}
	client := meilisearch.New(a.cfg.Search.URL, meilisearch.WithAPIKey(a.cfg.Search.APIKey))
	a.search = client
	a.lc.RegisterShutdownHook("search", func(context.Context) error { client.Close(); return nil })
	a.health.RegisterReadinessCheck("search", false, func(ctx context.Context) checkResult {
		return timedCheck(ctx, func(ctx context.Context) error { return searchHealthy(ctx, client) })
	})
	if err := searchHealthy(ctx, client); err != nil {
		return fmt.Errorf("meilisearch at %s is unavailable, search falls back to SQL: %w", a.cfg.Search.URL, err)
	}
	return nil
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
