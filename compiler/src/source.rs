//! Where a model comes from: a checkpoint folder (config.json + safetensors)
//! or a bare config.json (enough for everything but running).

use crate::config::{ConfigError, ModelConfig};
use crate::family::load_config;
use crate::weights::checkpoint::{INDEX_FILE, SINGLE_FILE};
use crate::weights::{Checkpoint, WeightsError};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{0}: no such file or folder (expected a checkpoint folder or its config.json)")]
    NotFound(PathBuf),
    #[error("{0}: no config.json in this folder (expected a Hugging Face checkpoint folder)")]
    NoConfig(PathBuf),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
}

pub struct ModelSource {
    pub config: ModelConfig,
    /// The folder holding the weights, when the source is a folder that has them.
    pub weights_dir: Option<PathBuf>,
}

impl ModelSource {
    /// A folder with config.json (weights optional), or a config.json file.
    pub fn open(path: &Path) -> Result<ModelSource, SourceError> {
        if path.is_dir() {
            let cfg_path = path.join("config.json");
            if !cfg_path.is_file() {
                return Err(SourceError::NoConfig(path.to_path_buf()));
            }
            let config = load_config(&cfg_path)?;
            // Anything at either name counts (a folder, a dangling link or a
            // device there is then reported by the checkpoint reader, not
            // silently taken for "no weights").
            let present = |name: &str| std::fs::symlink_metadata(path.join(name)).is_ok();
            let has_weights = present(SINGLE_FILE) || present(INDEX_FILE);
            Ok(ModelSource { config, weights_dir: has_weights.then(|| path.to_path_buf()) })
        } else if std::fs::symlink_metadata(path).is_ok() {
            // A file, or something that is not one (a device, a dangling
            // link): the config reader says which.
            Ok(ModelSource { config: load_config(path)?, weights_dir: None })
        } else {
            Err(SourceError::NotFound(path.to_path_buf()))
        }
    }

    pub fn checkpoint(&self) -> Result<Option<Checkpoint>, SourceError> {
        Ok(match &self.weights_dir {
            Some(d) => Some(Checkpoint::open(d)?),
            None => None,
        })
    }
}
