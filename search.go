package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/meilisearch/meilisearch-go"
)

// componentSearch is the Meilisearch client.
var componentSearch = component{name: "search"}

// searchConfig is the search block's settings.
type searchConfig struct {
	URL    string
	APIKey string
}

func (c *searchConfig) settings() []configSetting {
	return []configSetting{
		{key: "search.url", env: "MEILI_URL", value: urlValue{p: &c.URL, schemes: []string{"http", "https"}},
			doc: "Meilisearch; empty skips phase 11"},
		{key: "search.apiKey", env: "MEILI_API_KEY", value: secretValue{p: &c.APIKey},
			doc: "Meilisearch API key"},
	}
}

// searchAdapter is phase 11. Search is an optional dependency: when it is down
// the boot goes on and the features that use it fall back (to SQL, say). Its
// readiness check is shown but never fails readiness.
func (a *app) searchAdapter(ctx context.Context, p *phaseRun) error {
	if !anyUses(a.features, usesSearch) {
		a.health.RegisterSkipped(componentSearch.String(), "no feature uses search")
		return skipPhase("no feature uses search")
	}
	if a.cfg.Search.URL == "" {
		a.health.RegisterSkipped(componentSearch.String(), "MEILI_URL is not set")
		return skipPhase("MEILI_URL is not set")
	}
	client := meilisearch.New(a.cfg.Search.URL, meilisearch.WithAPIKey(a.cfg.Search.APIKey))
	a.search = client
	a.lc.RegisterShutdownHook(componentSearch, func(context.Context) error { client.Close(); return nil })
	// Meilisearch's errors repeat the request URL with its query and user:
	// scrubbed here, they reach neither the phase note (/admin/lifecycle) nor
	// the ops readiness body, which the log's redact hook does not cover.
	scrub := redactHook{secrets: connPasswords(a.cfg.Search.URL)}
	healthy := func(ctx context.Context) error { return scrub.err(searchHealthy(ctx, client)) }
	a.health.RegisterReadinessCheck(componentSearch.String(), false, func(ctx context.Context) checkResult {
		return timedCheck(ctx, healthy)
	})
	if err := healthy(ctx); err != nil {
		return fmt.Errorf("meilisearch at %s is unavailable, search falls back to SQL: %w", redactConnString(a.cfg.Search.URL), err)
	}
	for _, f := range a.features {
		for _, ix := range f.searchIndexes {
			if err := ensureIndex(ctx, client, ix); err != nil {
				return fmt.Errorf("preparing the %s index of feature %s, its search falls back: %w", ix.uid, f.name, err)
			}
		}
	}
	return nil
}

// searchIndex is a Meilisearch index a feature searches: phase 11 creates it
// with its primary key and searchable attributes.
type searchIndex struct {
	uid, primaryKey string
	searchable      []string
}

// ensureIndex creates the index and its settings. Meilisearch applies both
// as asynchronous tasks, and creating an index that exists is a task that
// fails harmlessly, so two instances booting at once need no lock.
func ensureIndex(ctx context.Context, client meilisearch.ServiceManager, ix searchIndex) error {
	if _, err := client.CreateIndex(ctx, &meilisearch.IndexConfig{Uid: ix.uid, PrimaryKey: ix.primaryKey}); err != nil {
		return err
	}
	_, err := client.Index(ix.uid).UpdateSearchableAttributes(ctx, &ix.searchable)
	return err
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
